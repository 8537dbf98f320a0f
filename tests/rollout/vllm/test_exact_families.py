"""Exact vLLM logprobs beyond Llama: Qwen2 (q/k/v biases, untied head), Qwen3 (q/k norms)
and Mistral, in bf16 (where plain vLLM differs most) with chunked prefill and prefix caching;
fp32 too under `exhaustive`. Negative control: plain vLLM on Qwen3 differs."""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout.vllm.folders import write_folder
from tests.helpers.rollout.vllm.common import (
    mismatches,
    require_vllm,
    run_engine,
    sharing_prompts,
    trainer_logprobs,
)

require_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

VOCAB = 999  # the smallest tiny vocabulary of these families
MAX_TOKENS = 6
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "enable_prefix_caching": True}
CASES = [
    pytest.param((name, dtype), id=f"{name}-{str(dtype)[6:]}", marks=marks)
    for name in ("tiny-qwen2", "tiny-qwen3", "tiny-mistral")
    for dtype, marks in ((torch.bfloat16, ()), (torch.float32, pytest.mark.exhaustive))
]


@pytest.fixture(scope="module", params=CASES)
def exact_run(request, tmp_path_factory):
    name, dtype = request.param
    folder = write_folder(name, dtype, tmp_path_factory.mktemp("exact"))
    prompts = sharing_prompts(VOCAB)
    run = run_engine(folder, dtype, prompts, exact=True, max_tokens=MAX_TOKENS, **ENGINE)
    return folder, dtype, prompts, run


def test_every_sampled_logprob_is_the_trainers(exact_run):
    folder, dtype, prompts, run = exact_run
    assert run.cached_tokens > 0, "no prompt was served from vLLM's prefix cache"
    expected = trainer_logprobs(folder, dtype, prompts, run.samples)
    assert mismatches(run.samples, expected) == []


def test_plain_vllm_differs(tmp_path):
    dtype = torch.bfloat16
    folder = write_folder("tiny-qwen3", dtype, tmp_path)
    prompts = sharing_prompts(VOCAB)
    run = run_engine(folder, dtype, prompts, exact=False, max_tokens=MAX_TOKENS, **ENGINE)
    assert len(mismatches(run.samples, trainer_logprobs(folder, dtype, prompts, run.samples))) > 0
