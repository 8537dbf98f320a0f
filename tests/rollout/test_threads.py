"""Parity across processes and intra-op thread counts: generate with 1 thread, recompute with 2 (and 3)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.invariance import run_with_threads

GENERATE = """
import torch
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.rollout.common import random_prompts, stop_ids

result = {}
for dtype in (torch.float32, torch.bfloat16):
    model, _ = load_model("{name}", dtype=dtype)
    apply_batch_invariant(model)
    vocab = model.config.vocab_size
    engine = RolloutEngine(model, device="cpu", max_batch_size=2, progress=False)
    sampling = SamplingParams(max_new_tokens=16, temperature=0.7, seed=5, stop_token_ids=stop_ids(vocab, 60))
    completions = engine.generate(random_prompts(vocab, (6, 13, 2, 9), seed=4), sampling)
    result[str(dtype)] = [(c.prompt_ids, c.token_ids, c.logprobs) for c in completions]
"""

RECOMPUTE = """
import torch
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.logprobs import token_logprobs
from tests.helpers.rollout.common import pad_batch

generated = {generated!r}
result = {{}}
for dtype in (torch.float32, torch.bfloat16):
    model, _ = load_model("{name}", dtype=dtype)
    apply_batch_invariant(model)
    seqs = [p + t for p, t, _ in generated[str(dtype)]]
    ids, mask, offsets = pad_batch(seqs, "right")
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature=0.7)
    result[str(dtype)] = [
        lp[row, len(p) - 1 : len(p) + len(t) - 1] for row, (p, t, _) in enumerate(generated[str(dtype)])
    ]
"""


def _check_threads(name: str, recompute_threads) -> None:
    generated = run_with_threads(GENERATE.replace("{name}", name), threads=1)
    plain = {k: [(p, t, None) for p, t, _ in v] for k, v in generated.items()}
    for threads in recompute_threads:
        code = RECOMPUTE.replace("{name}", name).format(generated=plain)
        recomputed = run_with_threads(code, threads=threads)
        for dtype, rows in generated.items():
            for (_, tokens, logprobs), ref in zip(rows, recomputed[dtype], strict=True):
                assert len(tokens) == logprobs.numel()
                assert torch.equal(logprobs, ref), (
                    f"{name} {dtype}: 1-thread rollout != {threads}-thread recompute"
                )


@pytest.mark.multiprocess
@pytest.mark.threads
def test_generate_with_one_thread_recompute_with_two():
    _check_threads("tiny-mistral", (2,))


@pytest.mark.multiprocess
@pytest.mark.threads
def test_moe_generate_with_one_thread_recompute_with_two_and_three():
    """Routing and experts too: a Qwen3-MoE rollout (1 thread) == recompute at 2 and 3 threads."""
    _check_threads("tiny-qwen3-moe", (2, 3))
