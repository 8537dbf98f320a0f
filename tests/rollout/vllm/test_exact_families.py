"""Exact vLLM logprobs beyond Llama: Qwen2 (q/k/v biases, untied head), Qwen3 (q/k norms)
and Mistral, in bf16 (where plain vLLM differs most) with chunked prefill and prefix caching;
fp32 too under `exhaustive`. Negative control: plain vLLM differs, family by family. The
families' engines run one after another in one process (one for exact, one for plain)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout.vllm.folders import write_folder
from tests.helpers.rollout.vllm.common import (
    EAGER,
    engine_spec,
    mismatches,
    require_vllm,
    run_engines,
    sharing_prompts,
    trainer_logprobs,
)

require_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.vllm_engines]

VOCAB = 999  # the smallest tiny vocabulary of these families
MAX_TOKENS = 6
FAMILIES = ("tiny-qwen2", "tiny-qwen3", "tiny-mistral")
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "enable_prefix_caching": True, **EAGER}


def family_runs(dtype: torch.dtype, root) -> dict:
    """Per family: (folder, prompts, the exact run, the plain run), all in `dtype`."""
    prompts = sharing_prompts(VOCAB)
    folders = [write_folder(name, dtype, root) for name in FAMILIES]
    specs = [engine_spec(f, dtype, prompts, max_tokens=MAX_TOKENS, **ENGINE) for f in folders]
    exact = run_engines(specs, exact=True)
    plain = run_engines(specs, exact=False)
    return {
        name: (folder, prompts, exact_run, plain_run)
        for name, folder, exact_run, plain_run in zip(FAMILIES, folders, exact, plain)
    }


@pytest.fixture(scope="module")
def bf16_runs(tmp_path_factory):
    return family_runs(torch.bfloat16, tmp_path_factory.mktemp("bf16"))


@pytest.fixture(scope="module")
def fp32_runs(tmp_path_factory):
    return family_runs(torch.float32, tmp_path_factory.mktemp("fp32"))


def assert_exact(runs, dtype):
    folder, prompts, run, _ = runs
    assert run.cached_tokens > 0, "no prompt was served from vLLM's prefix cache"
    expected = trainer_logprobs(folder, dtype, prompts, run.samples)
    assert mismatches(run.samples, expected) == []


def assert_plain_differs(runs, dtype):
    folder, prompts, _, run = runs
    assert len(mismatches(run.samples, trainer_logprobs(folder, dtype, prompts, run.samples))) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_every_sampled_logprob_is_the_trainers(bf16_runs, family):
    assert_exact(bf16_runs[family], torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
def test_plain_vllm_differs(bf16_runs, family):
    assert_plain_differs(bf16_runs[family], torch.bfloat16)


@pytest.mark.exhaustive
@pytest.mark.parametrize("family", FAMILIES)
def test_every_sampled_logprob_is_the_trainers_in_fp32(fp32_runs, family):
    assert_exact(fp32_runs[family], torch.float32)


@pytest.mark.exhaustive
@pytest.mark.parametrize("family", FAMILIES)
def test_plain_vllm_differs_in_fp32(fp32_runs, family):
    assert_plain_differs(fp32_runs[family], torch.float32)
