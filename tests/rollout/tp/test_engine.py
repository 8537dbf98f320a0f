"""`TensorParallelEngine` in a world of one rank (in-process): the RolloutEngine's bits.

Chain (torch.equal): a TP = 1 engine (sharded over one rank: every projection a
`ShardedLinear`, rank 0 scoring and broadcasting its samples) gives the completions and
logprobs of a `RolloutEngine` on the same patched model; negative control: a model with
other weights does not. Multi-rank engines: test_launch.py. Also: `load_shards` reads a
safetensors file (a tied head stored once) into the engine and bumps its version, and a
turn-end hook is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.tp import TensorParallelEngine
from tests.helpers.rollout.common import fresh_model, patched_model, random_prompts

SAMPLING = SamplingParams(max_new_tokens=5, seed=2, stop_token_ids=(17,))
PROMPTS = random_prompts(1000, (3, 7, 2, 5), seed=4)


def _tp1(seed: int = 0) -> TensorParallelEngine:
    return TensorParallelEngine(
        fresh_model("tiny-llama", seed=seed), device="cpu", max_batch_size=3, progress=False
    )


def _bits(completions):
    return [(c.token_ids, c.logprobs) for c in completions]


def _same(a, b) -> bool:
    return all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, b, strict=True))


def test_a_one_rank_engine_has_the_rolloutengines_bits(one_rank_group):
    engine = _tp1()
    assert (engine.tp_rank, engine.tensor_parallel_size) == (0, 1)
    reference = RolloutEngine(
        patched_model("tiny-llama"), device="cpu", max_batch_size=3, progress=False
    )
    want = _bits(reference.generate(PROMPTS, SAMPLING))
    assert _same(_bits(engine.generate(PROMPTS, SAMPLING)), want)
    assert not _same(_bits(_tp1(seed=1).generate(PROMPTS, SAMPLING)), want)


def test_load_shards_reads_a_file_into_the_engine(tmp_path, one_rank_group):
    other = fresh_model("tiny-llama", seed=1)
    tensors = {k: v.detach().contiguous() for k, v in other.state_dict().items()}
    del tensors["lm_head.weight"]  # tied: stored once, as Hugging Face does
    save_file(tensors, tmp_path / "w.safetensors")
    engine = _tp1()
    read = engine.load_shards(tmp_path / "w.safetensors", version=3)
    assert engine.weight_version == 3 and read == engine.last_load_bytes > 0
    for name, value in engine.model.state_dict().items():
        assert torch.equal(value, other.state_dict()[name]), name


def test_a_turn_end_hook_is_refused(one_rank_group):
    with pytest.raises(NotImplementedError, match="no on_turn_end"):
        _tp1().generate_episodes([], SAMPLING, lambda *a: None, max_total_tokens=8)
