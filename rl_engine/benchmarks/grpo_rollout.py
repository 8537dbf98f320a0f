"""The GRPO-shaped rollout of `rl-engine bench rollout`: one prefill per group on / off.

`prompts` prompts of about `prompt_tokens` random token ids (lengths spread over +-1/8, so
prefills are ragged), `SamplingParams(n=samples)`, `new_tokens` sampled tokens at T = 1, no
stop; the patched model in `dtype`, an engine whose slots hold every sample at once. It
times whole `generate` calls (prefill included) with `share_prompt_prefill` on and off,
interleaved, best of `repeats`, and raises unless both give the same tokens and logprobs bit
for bit. It also times calls of one new token (the prefill and the first draw): a whole
call's time minus that one is its decode.
"""

from __future__ import annotations

import time

import torch

from rl_engine.benchmarks.timing import intra_op_threads
from rl_engine.rollout import RolloutEngine, SamplingParams


def grpo_prompts(vocab: int, prompts: int, prompt_tokens: int) -> list[list[int]]:
    """`prompts` random prompts of prompt_tokens +- prompt_tokens / 8 ids in [3, vocab)."""
    g = torch.Generator().manual_seed(0)
    spread = max(prompt_tokens // 8, 1)
    lengths = torch.randint(
        prompt_tokens - spread, prompt_tokens + spread + 1, (prompts,), generator=g
    )
    return [torch.randint(3, vocab, (int(n),), generator=g).tolist() for n in lengths]


def _run(model, prompts, sampling: SamplingParams, share: bool):
    engine = RolloutEngine(
        model,
        device="cpu",
        max_batch_size=len(prompts) * sampling.n,
        progress=False,
        share_prompt_prefill=share,
    )
    start = time.perf_counter()
    completions = engine.generate(prompts, sampling)
    return time.perf_counter() - start, completions, engine.last_stats


def check_equal(on, off) -> None:
    for a, b in zip(on, off, strict=True):
        if a.token_ids != b.token_ids or not torch.equal(a.logprobs, b.logprobs):
            raise RuntimeError(
                f"prompt {a.prompt_index} sample {a.sample_index}: sharing the prefill changed "
                "the tokens or logprobs"
            )


def bench_grpo(
    model,
    *,
    prompts: int,
    prompt_tokens: int,
    samples: int,
    new_tokens: int,
    threads: int,
    repeats: int,
) -> dict:
    """Whole-call seconds with sharing on and off (best of `repeats`) and the prefill counts."""
    ids = grpo_prompts(model.config.vocab_size, prompts, prompt_tokens)
    sampling = SamplingParams(n=samples, max_new_tokens=new_tokens, temperature=1.0, seed=0)
    first = SamplingParams(n=samples, max_new_tokens=1, temperature=1.0, seed=0)
    best = dict.fromkeys([True, False, "first on", "first off"], float("inf"))
    runs = {}
    with intra_op_threads(threads):
        for _ in range(repeats):
            for share in (True, False):
                seconds, completions, stats = _run(model, ids, sampling, share)
                best[share] = min(best[share], seconds)
                runs[share] = completions, stats
                key = "first on" if share else "first off"
                best[key] = min(best[key], _run(model, ids, first, share)[0])
    check_equal(runs[True][0], runs[False][0])
    on, off = runs[True][1], runs[False][1]
    return {
        "shape": f"{prompts} x ~{prompt_tokens} tok x n={samples}, {new_tokens} new",
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "threads": threads,
        "on": best[True],
        "off": best[False],
        "first_on": best["first on"],
        "first_off": best["first off"],
        "prefill_tokens_on": on.prefill_tokens,
        "prefill_tokens_off": off.prefill_tokens,
        "shared": on.shared_prefills,
    }


def markdown_table(row: dict) -> str:
    return "\n".join(
        [
            "| GRPO-shaped rollout | dtype | threads | whole call s, sharing on | whole call s, off "
            "| off / on | 1-token call s, on | 1-token call s, off "
            "| prefill tokens on | prefill tokens off | shared prefills | tokens and logprobs |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
            f"| {row['shape']} | {row['dtype']} | {row['threads']} | {row['on']:.2f} "
            f"| {row['off']:.2f} | {row['off'] / row['on']:.2f}x | {row['first_on']:.2f} "
            f"| {row['first_off']:.2f} | {row['prefill_tokens_on']} "
            f"| {row['prefill_tokens_off']} | {row['shared']} | equal |",
        ]
    )
