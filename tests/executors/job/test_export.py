"""`rl-engine export`: a checkpoint's weights become a Hugging Face folder that loads back to the
same tensors (torch.equal), and every refusal names what is wrong: a missing run directory, a
non-empty --to, a step without a checkpoint (listing the steps there are), --merged on a run
without LoRA adapters."""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.export import export_checkpoint
from rl_engine.executors.worker.weights.weights_file import WEIGHTS_FILE, save_state_dict
from rl_engine.models import load_model


def run_with_checkpoint(tmp_path, weights: dict, step: int = 2):
    run = tmp_path / "run"
    staging = ckpt.begin(run, step)
    save_state_dict(staging / WEIGHTS_FILE, weights)
    config = RunConfig.from_dict({"model": "tiny-llama", "output_dir": str(run)})
    ckpt.write_driver_part(
        staging, step=step, weight_version=step, config=config, weights_only=True
    )
    ckpt.commit(run, staging, keep_last=1)
    return run


def test_exported_folder_loads_back_the_checkpoints_tensors(tmp_path):
    model, _ = load_model(
        "tiny-llama", seed=1
    )  # not the run's seed: the weights must come from the checkpoint
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    run = run_with_checkpoint(tmp_path, weights)
    out = export_checkpoint(run, tmp_path / "hf")
    assert out == tmp_path / "hf" and (out / "config.json").is_file()
    loaded, _ = load_model(str(out))
    state = loaded.state_dict()
    assert state.keys() == weights.keys()
    assert all(torch.equal(state[k], weights[k]) for k in weights)
    fresh, _ = load_model("tiny-llama")  # negative control: the run's own seed differs
    assert not all(torch.equal(fresh.state_dict()[k], weights[k]) for k in weights)
    assert not list(tmp_path.glob(".hf.tmp"))


def test_a_missing_run_directory_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"run directory '.*nowhere' does not exist"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "hf")


def test_a_non_empty_target_is_refused(tmp_path):
    run = run_with_checkpoint(tmp_path, {"w": torch.zeros(1)})
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(ValueError, match=r"--to '.*hf' already exists and is not empty"):
        export_checkpoint(run, tmp_path / "hf")
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"


def test_a_step_without_checkpoint_lists_the_steps_there_are(tmp_path):
    run = run_with_checkpoint(tmp_path, {"w": torch.zeros(1)}, step=2)
    with pytest.raises(ValueError, match=r"no checkpoint at step 5; checkpoints at steps \[2\]"):
        export_checkpoint(run, tmp_path / "hf", step=5)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no checkpoint yet"):
        export_checkpoint(tmp_path / "empty", tmp_path / "hf")


def test_merged_needs_lora_adapters(tmp_path):
    run = run_with_checkpoint(tmp_path, {"w": torch.zeros(1)})
    with pytest.raises(ValueError, match="--merged .* lora.rank 0"):
        export_checkpoint(run, tmp_path / "hf", merged=True)
    assert not (tmp_path / "hf").exists()
