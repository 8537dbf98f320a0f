"""`rl-engine bench rollout --case tail`: exact speculative decoding on the long tail of a step.

A GRPO step's rollout time is set by its longest samples: once most have finished, the engine
decodes a few long ones at batch 1-4. Three cases on the patched SmolLM2-135M-Instruct (bf16,
2 threads), each run without and with prompt-lookup speculation (`rollout.speculative: {method:
ngram, num_tokens: k}`), best of `repeats` after a warm-up, with the completions checked equal
in tokens and logprobs (the bench raises otherwise):

- tail: the bench's 8 chat prompts x 4 samples (32 sequences, one engine slot each), at T = 1;
  seven prompts get a budget of `short` tokens, one of 8x that (per-prompt budgets,
  `generate(..., budgets=...)`; no EOS stop, so the shape is exact): the whole step's seconds,
  and the seconds of its decode forwards at batch <= 4;
- repetitive: batch 1, greedy, a prompt that asks for a paragraph copied word for word: prompt
  lookup drafts the copy from the prompt (tokens/s without and with; ends at EOS);
- arithmetic: batch 1, the shipped arithmetic task's first prompt, at T = 1 (tokens/s without
  and with).

`--tiny`: a 1-layer tiny model, random token prompts and short budgets (the figures mean
nothing).
"""

from __future__ import annotations

import logging
import time

import torch

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.rollout import QUESTIONS, encode_prompts, random_prompts
from rl_engine.benchmarks.timing import intra_op_threads
from rl_engine.data.tasks import ArithmeticTask
from rl_engine.models import SMOLLM2_NAME, load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.speculative import SpeculativeParams

REPEAT = (
    "Copy the following paragraph exactly, word for word: The quick brown fox jumps over the "
    "lazy dog. The dog sleeps in the sun while the fox runs into the forest to find food for "
    "its family. In the evening the fox comes back with a rabbit, and the dog wakes up to "
    "watch the sun go down behind the hills. The farmer closes the gate, feeds the chickens "
    "and walks home along the river, where the children are still playing with a red ball."
)


def run(model, prompts, sampling, k: int | None, budgets=None, slots: int | None = None):
    """(seconds, completions, stats) of one generate call, speculating with k drafts (None: off)."""
    params = None if k is None else SpeculativeParams(method="ngram", num_tokens=k)
    slots = slots or len(prompts) * sampling.n
    engine = RolloutEngine(
        model, device="cpu", max_batch_size=slots, progress=False, speculative=params
    )
    start = time.perf_counter()
    completions = engine.generate(prompts, sampling, budgets=budgets)
    return time.perf_counter() - start, completions, engine.last_stats


def best(model, prompts, sampling, k, repeats: int, budgets=None):
    """The fastest of `repeats` runs after a warm-up (same completions every run)."""
    run(model, prompts, sampling, k, budgets)
    runs = [run(model, prompts, sampling, k, budgets) for _ in range(repeats)]
    return min(runs, key=lambda r: r[0])


def check_equal(plain, speculated, case: str) -> None:
    for a, b in zip(plain, speculated, strict=True):
        if a.token_ids != b.token_ids or not torch.equal(a.logprobs, b.logprobs):
            raise AssertionError(
                f"{case}: speculation changed a completion (prompt {a.prompt_index})"
            )


def small_batch_seconds(stats, most: int = 4) -> float:
    return sum(s for s, b in zip(stats.decode_seconds, stats.batch_sizes) if b <= most)


def row(case: str, k: int, off, on) -> dict:
    """One table row from the (seconds, completions, stats) of the runs without and with."""
    tokens = sum(len(c.token_ids) for c in off[1])
    spec = on[2].speculation
    return {
        "case": case,
        "k": k,
        "tokens": tokens,
        "off s": off[0],
        "on s": on[0],
        "off tok/s": tokens / off[0],
        "on tok/s": tokens / on[0],
        "on / off": off[0] / on[0],
        "off s at batch <= 4": small_batch_seconds(off[2]),
        "on s at batch <= 4": small_batch_seconds(on[2]),
        "accept rate": spec.accept_rate,
        "tokens / forward": spec.tokens_per_forward,
        "bits": "equal",
    }


def markdown_table(rows: list[dict]) -> str:
    keys = list(rows[0])
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    for r in rows:
        cells = [f"{v:.3g}" if isinstance(v, float) else str(v) for v in r.values()]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def cases(model, tokenizer, tiny: bool, short: int):
    """(name, prompts, sampling, budgets) of the three cases."""
    vocab = model.config.vocab_size
    if tiny:
        chat = random_prompts(vocab, len(QUESTIONS))
        repeat, arithmetic = [[7, 8, 9, 10] * 6], random_prompts(vocab, 1, 16)
    else:
        chat = encode_prompts(tokenizer, len(QUESTIONS))
        messages = [{"role": "user", "content": REPEAT}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        repeat = [tokenizer(text, add_special_tokens=False)["input_ids"]]
        arithmetic = ArithmeticTask(tokenizer).prompts(1, 0)
    long = 8 * short
    tail = SamplingParams(max_new_tokens=long, temperature=1.0, n=4, seed=0)
    budgets = [short] * (len(chat) - 1) + [long]
    eos = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else None
    return [
        ("tail", chat, tail, budgets),
        (
            "repetitive",
            repeat,
            SamplingParams(max_new_tokens=long, temperature=0.0, eos_token_id=eos),
            None,
        ),
        (
            "arithmetic",
            arithmetic,
            SamplingParams(max_new_tokens=long, seed=0, eos_token_id=eos),
            None,
        ),
    ]


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="1 repetition")
    parser.add_argument("--model", default=SMOLLM2_NAME, help="a load_model spec")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--num-tokens", type=int, default=4, help="k: drafts per step")
    parser.add_argument("--short", type=int, default=16, help="the short samples' budget")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats = 1
    if args.tiny:
        args.model, args.short, args.repeats, args.threads = "tiny-llama", 2, 1, 1
    logging.basicConfig(level=logging.WARNING)
    model, tokenizer = load_model(args.model, dtype=getattr(torch, args.dtype))
    apply_batch_invariant(model)
    rows = []
    with intra_op_threads(args.threads):
        for name, prompts, sampling, budgets in cases(model, tokenizer, args.tiny, args.short):
            off = best(model, prompts, sampling, None, args.repeats, budgets)
            on = best(model, prompts, sampling, args.num_tokens, args.repeats, budgets)
            check_equal(off[1], on[1], name)
            rows.append(row(name, args.num_tokens, off, on))
            print(f"  {name}: off {off[0]:.2f} s, on {on[0]:.2f} s", flush=True)
    print(f"{args.model} {args.dtype}, {args.threads} threads, prompt lookup k = {args.num_tokens}")
    table = markdown_table(rows)
    print()
    print(table)
    return table


if __name__ == "__main__":
    main()
