"""vLLM's CPU build under RL_ENGINE_BATCH_INVARIANT=1 returns, for every sampled token of a
tiny Llama, the trainer's logprob bit for bit: fp32 and bf16, one request at a time and
batches of 8 and 32, chunked prefill forced (64 tokens a step), prefix caching on, prompt
lengths across KV block boundaries and prompts sharing prefixes. Negative control: the
same engine without the variable (plain vLLM) differs."""

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

MODEL = "tiny-llama"
VOCAB = 1000
MAX_TOKENS = 8
# (dtype, max_num_seqs): a lone request, a batch of 8, and every request in one batch of 32
LAYOUTS = [(torch.float32, 1), (torch.float32, 8), (torch.bfloat16, 32)]
ENGINE = {"max_num_batched_tokens": 64, "enable_prefix_caching": True}


@pytest.fixture(scope="module", params=LAYOUTS, ids=lambda p: f"{p[0]}-seqs{p[1]}")
def exact_run(request, tmp_path_factory):
    dtype, seqs = request.param
    folder = write_folder(MODEL, dtype, tmp_path_factory.mktemp("exact"))
    prompts = sharing_prompts(VOCAB)
    run = run_engine(
        folder, dtype, prompts, exact=True, max_tokens=MAX_TOKENS, max_num_seqs=seqs, **ENGINE
    )
    return folder, dtype, prompts, run


def test_every_sampled_logprob_is_the_trainers(exact_run):
    folder, dtype, prompts, run = exact_run
    assert run.cached_tokens > 0, "no prompt was served from vLLM's prefix cache"
    assert [len(tokens) for tokens, _ in run.samples] == [MAX_TOKENS] * len(prompts)
    expected = trainer_logprobs(folder, dtype, prompts, run.samples)
    assert mismatches(run.samples, expected) == []


def test_plain_vllm_differs(tmp_path):
    """Negative control: without the variable vLLM runs its own model code, and its
    logprobs of the same prompts are not the trainer's."""
    dtype = torch.bfloat16
    folder = write_folder(MODEL, dtype, tmp_path)
    prompts = sharing_prompts(VOCAB)
    run = run_engine(
        folder, dtype, prompts, exact=False, max_tokens=MAX_TOKENS, max_num_seqs=8, **ENGINE
    )
    expected = trainer_logprobs(folder, dtype, prompts, run.samples)
    assert len(mismatches(run.samples, expected)) > 0
