"""The RL job end to end on a mixture-of-experts policy (tiny Qwen3-MoE), real Ray and DeepSpeed.

Chain checked: every step's trainer logprobs == the rollout engine's (strict
parity: a single mismatching token would raise; the metrics say 1.0 exact, max
|dlogp| 0), with the router's auxiliary loss on and its load metrics reported;
then `rl-engine export` of step 1 -> `AutoModelForCausalLM.from_pretrained` ->
patched token_logprobs == those of the checkpoint's weights, bit for bit.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.cli import main
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from tests.helpers.job.jobs import job_config

pytestmark = pytest.mark.multiprocess


def test_moe_job_has_parity_one_at_every_step_and_exports_the_same_logprobs(tmp_path, job_ray):
    from transformers import AutoModelForCausalLM

    from rl_engine.logprobs import token_logprobs
    from rl_engine.models import load_model
    from rl_engine.patching import apply_batch_invariant

    run, out = tmp_path / "run", tmp_path / "hf"
    config = job_config(
        run, steps=2, checkpoint={"every": 1}, algorithm={"router_aux_loss_coef": 0.01}
    )
    config = type(config).from_dict({**config.to_dict(), "model": "tiny-qwen3-moe"})
    history = run_job(config)
    assert [m["step"] for m in history] == [0, 1]
    for m in history:
        assert m["parity/exact_match_fraction"] == 1.0 and m["parity/max_abs_diff"] == 0.0
        assert m["parity/num_tokens"] > 0 and m["skipped_update"] == 0
        assert math.isfinite(m["router/aux_loss"]) and m["router/aux_loss"] > 0
        assert 1 / 8 <= m["router/max_load_share"] <= 1.0

    assert main(["export", str(run), "--to", str(out), "--step", "1"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    trained, _ = load_model(config.model, dtype=torch.float32, seed=config.seed)
    trained.load_state_dict(ckpt.at_step(run, 1).load_weights(), strict=True)
    ids = torch.randint(
        3, trained.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        scores = [token_logprobs(apply_batch_invariant(m).model, ids) for m in (exported, trained)]
    assert torch.equal(scores[0], scores[1])
