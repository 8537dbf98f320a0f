"""vLLM's CPU build under RL_ENGINE_BATCH_INVARIANT=1 returns, for every sampled token of a
tiny Llama, the trainer's logprob bit for bit: fp32 and bf16, one request at a time and
batches of 8 and 32, chunked prefill forced (64 tokens a step), prefix caching on, prompt
lengths across KV block boundaries and prompts sharing prefixes. Negative control: the
same engine runs without the variable (plain vLLM) differ, layout by layout. The layouts'
engines run one after another in one process (one for exact, one for plain)."""

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

MODEL = "tiny-llama"
VOCAB = 1000
MAX_TOKENS = 8
# (dtype, max_num_seqs): a lone request, a batch of 8, and every request in one batch of 32
LAYOUTS = [(torch.float32, 1), (torch.float32, 8), (torch.bfloat16, 32)]
LAYOUT_IDS = [f"{str(dtype)[6:]}-seqs{seqs}" for dtype, seqs in LAYOUTS]
ENGINE = {"max_num_batched_tokens": 64, "enable_prefix_caching": True, **EAGER}


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    """Per layout: (folder, dtype, prompts, the exact run, the plain run)."""
    root = tmp_path_factory.mktemp("llama")
    prompts = sharing_prompts(VOCAB)
    folders = {dtype: write_folder(MODEL, dtype, root) for dtype in {d for d, _ in LAYOUTS}}
    specs = [
        engine_spec(
            folders[dtype], dtype, prompts, max_tokens=MAX_TOKENS, max_num_seqs=seqs, **ENGINE
        )
        for dtype, seqs in LAYOUTS
    ]
    exact = run_engines(specs, exact=True)
    plain = run_engines(specs, exact=False)
    return [
        (folders[dtype], dtype, prompts, exact_run, plain_run)
        for (dtype, _), exact_run, plain_run in zip(LAYOUTS, exact, plain)
    ]


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=LAYOUT_IDS)
def test_every_sampled_logprob_is_the_trainers(layouts, layout):
    folder, dtype, prompts, run, _ = layouts[layout]
    assert run.cached_tokens > 0, "no prompt was served from vLLM's prefix cache"
    assert [len(tokens) for tokens, _ in run.samples] == [MAX_TOKENS] * len(prompts)
    expected = trainer_logprobs(folder, dtype, prompts, run.samples)
    assert mismatches(run.samples, expected) == []


@pytest.mark.parametrize("layout", range(len(LAYOUTS)), ids=LAYOUT_IDS)
def test_plain_vllm_differs(layouts, layout):
    """Negative control: without the variable vLLM runs its own model code, and its
    logprobs of the same prompts are not the trainer's."""
    folder, dtype, prompts, _, run = layouts[layout]
    expected = trainer_logprobs(folder, dtype, prompts, run.samples)
    assert len(mismatches(run.samples, expected)) > 0
