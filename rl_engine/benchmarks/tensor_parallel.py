"""`rl-engine bench rollout --case tp`: a TP = 2 engine vs one engine, at equal total threads.

A patched Llama-shaped model (random init; hidden 1024, 16 query / 8 KV heads of 64,
MLP 2816, vocabulary 32000, fp32 or bf16) generates for 4 prompts of 128 tokens:
with `max_new_tokens = 1` (the prefill forward and one LM-head call) and with 1 + K
(K decode steps). TP = 1: one process with 2 intra-op threads (and, for reference, 1);
TP = 2: two processes (rl_engine.rollout.tp.launch) of 1 thread each. Prefill step = t(1); decode step =
(best t(1 + K) - best t(1)) / K over `repeats` rounds. Both engines give the same tokens (checked).

Bytes sent per token per layer: counted by the TP ranks' gathers during the K decode
steps, next to the formulas of this design, (N - 1) / N * (Hq * D + I + 2 * H)
elements per rank, and of Megatron-style TP, two ring all-reduces of H elements,
2 * 2 * (N - 1) / N * H. `--tiny`: a 1-layer model of a tiny config, fp32, 2 short prompts.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch

from rl_engine.benchmarks.args import bench_parser


@dataclass(frozen=True)
class Shape:
    """The model (a Llama config) and the prompts it generates for."""

    vocab: int = 32000
    hidden: int = 1024
    intermediate: int = 2816
    heads: int = 16
    kv_heads: int = 8
    prompts: int = 4
    prompt_len: int = 128


FULL = Shape()
TINY = Shape(vocab=1000, hidden=128, intermediate=256, heads=4, kv_heads=2, prompts=2, prompt_len=8)


def build(layers: int, dtype: str, shape: Shape = FULL):
    from rl_engine.models.build import hf_config, random_model
    from rl_engine.patching import apply_batch_invariant

    config = hf_config(
        "llama",
        vocab_size=shape.vocab,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = random_model(config, torch.float32)
    model = model.to(getattr(torch, dtype)).eval()
    apply_batch_invariant(model)
    return model


def _prompts(shape: Shape) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(3, shape.vocab, (shape.prompt_len,), generator=g).tolist()
        for _ in range(shape.prompts)
    ]


def measure(
    layers: int,
    dtype: str,
    new_tokens: int,
    repeats: int,
    tp: bool,
    rank=0,
    world=1,
    shape: Shape = FULL,
):
    """Best prefill and decode step seconds, tokens, and (TP) bytes sent per decode token."""
    from rl_engine.rollout import RolloutEngine, SamplingParams

    model = build(layers, dtype, shape)
    batch = shape.prompts
    if tp:
        from rl_engine.rollout.tp import TensorParallelEngine

        engine = TensorParallelEngine(model, device="cpu", max_batch_size=batch, progress=False)
    else:
        engine = RolloutEngine(model, device="cpu", max_batch_size=batch, progress=False)
    prompts = _prompts(shape)

    def run(n: int):
        sampling = SamplingParams(max_new_tokens=n, temperature=0.0)
        sent = engine.shards.sent_layer_bytes if tp else 0
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        seconds = time.perf_counter() - start
        return seconds, (engine.shards.sent_layer_bytes - sent if tp else 0), out

    run(2)  # warm-up
    prefill, whole, sent_decode = [], [], 0
    for _ in range(repeats):  # a fixed count: every TP rank runs the same collectives
        t1, sent1, _ = run(1)
        tk, sentk, out = run(1 + new_tokens)
        prefill.append(t1)
        whole.append(tk)
        sent_decode = sentk - sent1
    # best K+1-token time less the best 1-token time: one noisy round cannot make it negative
    decode = (min(whole) - min(prefill)) / new_tokens
    if decode <= 0:
        raise RuntimeError(
            f"decode step not measurable: the {1 + new_tokens}-token runs were no slower than "
            f"the 1-token runs in {repeats} rounds; raise the decode steps or the repeats"
        )
    per_token_layer = sent_decode / (new_tokens * shape.prompts * layers)
    return {
        "prefill": min(prefill),
        "decode": decode,
        "tokens": [c.token_ids for c in out],
        "sent_per_token_layer": per_token_layer,
    }


def _tp1(layers, dtype, new_tokens, repeats, shape: Shape, threads: int = 2):
    torch.set_num_threads(threads)
    return measure(layers, dtype, new_tokens, repeats, tp=False, shape=shape)


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="2 layers, 4 decode steps, best of 1")
    args = parser.parse_args(argv)
    shape, dtypes = FULL, ("float32", "bfloat16")
    layers, new_tokens, repeats = (2, 4, 1) if args.quick else (4, 16, 3)
    if args.tiny:
        shape, dtypes, (layers, new_tokens, repeats) = TINY, ("float32",), (1, 8, 2)
    # a tiny run measures TP = 1 in this process: two process starts fewer, same code path
    table = run(shape, dtypes, layers, new_tokens, repeats, reference_in_process=args.tiny)
    print(table)
    return table


def run(
    shape: Shape,
    dtypes,
    layers: int,
    new_tokens: int,
    repeats: int,
    *,
    reference_in_process: bool = False,
) -> str:
    """The two tables: measured prefill / decode per dtype, and bytes sent per token. TP = 1
    runs in a process of its own (like each TP = 2 rank), or in this one."""
    from rl_engine.benchmarks.timing import intra_op_threads
    from rl_engine.rollout.tp import launch

    def tp1(args, threads: int):
        if not reference_in_process:
            return launch(lambda_free(_tp1, *args, shape, threads), 1, threads_per_rank=threads)
        with intra_op_threads(threads):
            return measure(*args, tp=False, shape=shape)

    rows = []
    for dtype in dtypes:
        args = (layers, dtype, new_tokens, repeats)
        one, single = tp1(args, 2), tp1(args, 1)
        two = launch(functools.partial(measure, *args, True, shape=shape), 2, threads_per_rank=1)
        if not one["tokens"] == single["tokens"] == two["tokens"]:
            raise RuntimeError("TP = 2 and TP = 1 sampled different tokens")
        rows.append(
            f"| {dtype} | {single['prefill'] * 1e3:.1f} | {one['prefill'] * 1e3:.1f} | "
            f"{two['prefill'] * 1e3:.1f} | {two['prefill'] / one['prefill']:.2f}x | "
            f"{single['decode'] * 1e3:.1f} | {one['decode'] * 1e3:.1f} | "
            f"{two['decode'] * 1e3:.1f} | {two['decode'] / one['decode']:.2f}x | "
            f"{two['sent_per_token_layer']:.0f} |"
        )
        print(rows[-1], flush=True)
    itemsize = {"float32": 4, "bfloat16": 2}
    h, q_width = shape.hidden, shape.hidden  # query width: heads x head dim = hidden
    traffic = [
        f"| {dtype} | {ours(h, q_width, shape.intermediate, 2) * itemsize[dtype]:.0f} | "
        f"{megatron(h, 2) * itemsize[dtype]:.0f} |"
        for dtype in dtypes
    ]
    return "\n".join(
        [
            f"{layers} layers, hidden {shape.hidden}, {shape.prompts} prompts x {shape.prompt_len} "
            f"tokens, {new_tokens} decode steps, "
            f"best of {repeats}; 2 threads in all",
            "",
            "| dtype | prefill TP=1 1 thread ms | prefill TP=1 2 threads ms | prefill TP=2 "
            "(2 x 1 thread) ms | TP2 / TP1 2 threads | decode step TP=1 1 thread ms | decode step "
            "TP=1 2 threads ms | decode step TP=2 ms | TP2 / TP1 2 threads | bytes sent / token / "
            "layer / rank (measured) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "| dtype | this design, formula (bytes / token / layer / rank) | Megatron-style TP |",
            "|---|---:|---:|",
            *traffic,
        ]
    )


def ours(hidden: int, q_width: int, intermediate: int, world: int) -> float:
    """Elements one rank sends per token per layer: all-gathers of the attention output, the
    o_proj output, the MLP width and the down_proj output (each 1/N of it to N - 1 ranks)."""
    return (world - 1) / world * (q_width + intermediate + 2 * hidden)


def megatron(hidden: int, world: int) -> float:
    """Elements one rank sends per token per layer in Megatron-style TP: two ring all-reduces
    (after attention, after the MLP) of H elements, 2 (N - 1) / N * H each."""
    return 2 * 2 * (world - 1) / world * hidden


def lambda_free(fn, *args):
    """A picklable `fn(*args)` for launch (which calls it with rank and world)."""
    return functools.partial(_drop_rank, fn, args)


def _drop_rank(fn, args, rank: int, world: int):
    return fn(*args)


if __name__ == "__main__":
    main()
