"""rl_engine's sampler inside vLLM: `VllmEngine` (the plugin's model, `ExactSampler`, each
request keyed by (seed, prompt, sample)) samples the completions the own engine samples from
the same folder, bit for bit: tokens, logprobs and finish reasons, at temperature 1, 0.7
with top-k and top-p, greedy, and with stop tokens; chunked prefill forced, prefix caching
on, prompts across KV block boundaries and sharing prefixes. Negative control: the same
engine with vLLM's own sampler draws other tokens."""

from __future__ import annotations

import pytest
import torch

from rl_engine.models.loading import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine
from rl_engine.rollout.sampling import SamplingParams
from rl_engine.rollout.vllm.folders import write_folder
from tests.helpers.rollout.vllm.common import (
    ENGINE_TIMEOUT_S,
    host_job,
    require_vllm,
    sharing_prompts,
)

require_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess, pytest.mark.vllm_engines]

VOCAB = 1000
SAMPLINGS = {
    "temperature-1": {"n": 3, "seed": 5, "max_new_tokens": 10},
    "temperature-0.7-top-k-top-p": {
        "n": 2,
        "seed": 6,
        "max_new_tokens": 10,
        "temperature": 0.7,
        "top_k": 20,
        "top_p": 0.9,
    },
    "greedy": {"n": 1, "max_new_tokens": 6, "temperature": 0.0},
    "stop-tokens": {
        "n": 3,
        "seed": 7,
        "max_new_tokens": 10,
        "stop_token_ids": list(range(3, 103)),  # ~10% of the vocabulary: most samples stop
        "eos_token_id": 2,
    },
}


def run_vllm_engine(folder, dtype: torch.dtype, prompts) -> dict:
    """sampler_run.py in the session's exact engine host (vLLM's settings precede its import)."""
    spec = {
        "folder": str(folder),
        "dtype": str(dtype).removeprefix("torch."),
        "llm": {"max_num_batched_tokens": 64},  # chunked prefill forced
        "prompts": prompts,
        "samplings": SAMPLINGS,
        "max_batch_size": 8,
    }
    return host_job("sampler", spec, exact=True, timeout=ENGINE_TIMEOUT_S)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(the vLLM process's output, the own engine's completions per sampling), bf16."""
    dtype = torch.bfloat16
    folder = write_folder("tiny-llama", dtype, tmp_path_factory.mktemp("sampler"))
    prompts = sharing_prompts(VOCAB)
    vllm_out = run_vllm_engine(folder, dtype, prompts)
    model, _ = load_model(folder, dtype=dtype)
    apply_batch_invariant(model)
    own = RolloutEngine(model, device="cpu", max_batch_size=4, progress=False)
    own_out = {
        name: own.generate(prompts, SamplingParams(**fields)) for name, fields in SAMPLINGS.items()
    }
    return vllm_out, own_out


@pytest.mark.parametrize("name", list(SAMPLINGS))
def test_vllm_samples_the_own_engines_completions(runs, name):
    vllm_out, own_out = runs
    got, want = vllm_out["exact"][name], own_out[name]
    assert [(c[3], c[4]) for c in got] == [(c.prompt_index, c.sample_index) for c in want]
    assert [c[0] for c in got] == [c.token_ids for c in want]
    assert [c[2] for c in got] == [c.finish_reason for c in want]
    for (_, logprobs, *_), completion in zip(got, want):
        assert torch.equal(torch.tensor(logprobs, dtype=torch.float32), completion.logprobs)


def test_the_stop_case_stops(runs):
    """The stop-token case is a real one: most samples end on a stop token, kept last."""
    _, own_out = runs
    reasons = [c.finish_reason for c in own_out["stop-tokens"]]
    assert reasons.count("stop") > len(reasons) // 2


def test_vllms_own_sampler_draws_other_tokens(runs):
    """Negative control: vLLM's Sampler, same engine and requests, samples other completions
    (greedy excepted: argmax needs no random draw)."""
    vllm_out, own_out = runs
    for name in ("temperature-1", "temperature-0.7-top-k-top-p", "stop-tokens"):
        plain = [c[0] for c in vllm_out["vllm_sampler"][name]]
        assert plain != [c.token_ids[: len(p)] for c, p in zip(own_out[name], plain)], name
