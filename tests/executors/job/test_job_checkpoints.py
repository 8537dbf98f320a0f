"""Checkpoint directories: a checkpoint is the latest only once committed complete, old ones are
pruned to keep_last, and asking for a step that is not kept names the steps that are."""

from __future__ import annotations

import pytest

from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.worker.weights.weights_file import WEIGHTS_FILE, save_state_dict


def test_checkpoint_is_latest_only_once_complete_and_old_ones_are_pruned(tmp_path):
    import torch

    from rl_engine.config import RunConfig

    config = RunConfig()
    for step in (1, 2, 3):
        staging = ckpt.begin(tmp_path, step)
        save_state_dict(staging / WEIGHTS_FILE, {"w": torch.full((2,), float(step))})
        ckpt.write_driver_part(
            staging,
            step=step,
            weight_version=step,
            config=config,
            weights_only=True,
        )
        assert ckpt.latest(tmp_path) is None or ckpt.latest(tmp_path).step == step - 1
        ckpt.commit(tmp_path, staging, keep_last=2)
    assert ckpt.complete_tags(tmp_path) == ["step000002", "step000003"]
    assert ckpt.latest(tmp_path).step == 3 and ckpt.latest(tmp_path).weights_only
    assert torch.equal(ckpt.at_step(tmp_path, 2).load_weights()["w"], torch.full((2,), 2.0))
    ckpt.begin(tmp_path, 4)  # a save that never finished
    assert ckpt.latest(tmp_path).step == 3
    with pytest.raises(ValueError, match=r"checkpoints at steps \[2, 3\]"):
        ckpt.at_step(tmp_path, 1)
