"""Exact vLLM logprobs on a real pretrained model: SmolLM2-135M-Instruct (the packaged GGUF,
dequantised into a Hugging Face folder), fp32 and bf16, chunked prefill and prefix caching,
batches of 8, eager (common.EAGER). Negative control: plain vLLM in bf16
differs (on every token, measured). The exact engines run one after another in one process."""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout.vllm.folders import write_smollm2_folder
from tests.helpers.rollout.vllm.common import (
    EAGER,
    NEEDS_SMOLLM2,
    engine_spec,
    mismatches,
    require_vllm,
    run_engines,
    sharing_prompts,
    trainer_logprobs,
)

require_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.vllm_engines, NEEDS_SMOLLM2]

VOCAB = 49152
MAX_TOKENS = 6
ENGINE = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "enable_prefix_caching": True, **EAGER}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("smollm2")
    return root, {name: write_smollm2_folder(dtype, root) for name, dtype in DTYPES.items()}


@pytest.fixture(scope="module")
def exact_runs(folders):
    root, paths = folders
    prompts = sharing_prompts(VOCAB)
    specs = [
        engine_spec(paths[name], dtype, prompts, max_tokens=MAX_TOKENS, **ENGINE)
        for name, dtype in DTYPES.items()
    ]
    return prompts, dict(zip(DTYPES, run_engines(specs, exact=True)))


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_every_sampled_logprob_is_the_trainers(folders, exact_runs, dtype_name):
    path, dtype = folders[1][dtype_name], DTYPES[dtype_name]
    prompts, runs = exact_runs
    run = runs[dtype_name]
    assert run.cached_tokens > 0, "no prompt was served from vLLM's prefix cache"
    assert mismatches(run.samples, trainer_logprobs(path, dtype, prompts, run.samples)) == []


def test_plain_vllm_differs(folders):
    root, paths = folders
    prompts = sharing_prompts(VOCAB)[:4]
    spec = engine_spec(paths["bf16"], torch.bfloat16, prompts, max_tokens=MAX_TOKENS, **ENGINE)
    (run,) = run_engines([spec], exact=False)
    expected = trainer_logprobs(paths["bf16"], torch.bfloat16, prompts, run.samples)
    assert len(mismatches(run.samples, expected)) > 0
