"""The LoRA base record of a checkpoint (executors/worker/weights/lora_base.py): resuming on the
same base (same content hash) passes; a full fine-tuning checkpoint under LoRA, a LoRA checkpoint
without LoRA, or another base is a ValueError naming the checkpoint and both bases."""

from __future__ import annotations

import json

import pytest

from rl_engine.executors.worker.weights.lora_base import LORA_BASE_FILE, check_base

BASE = {"model": "tiny-llama", "hash": "abc123"}


def checkpoint(directory, record: dict | None, tag: str = "global_step1"):
    (directory / tag).mkdir()
    (directory / "latest").write_text(tag + "\n")
    if record is not None:
        (directory / tag / LORA_BASE_FILE).write_text(json.dumps(record))
    return directory


def test_no_checkpoint_and_matching_records_pass(tmp_path):
    check_base(tmp_path, None, BASE)  # nothing saved yet: load_checkpoint reports that
    checkpoint(tmp_path, BASE)
    check_base(tmp_path, None, BASE)
    check_base(tmp_path, "global_step1", {"model": "/copy/of/tiny-llama", "hash": "abc123"})


def test_a_lora_checkpoint_without_lora_is_named(tmp_path):
    checkpoint(tmp_path, BASE)
    with pytest.raises(
        ValueError,
        match=r"holds LoRA adapters \(of base 'tiny-llama'\) but this run has lora\.rank 0",
    ):
        check_base(tmp_path, None, None)


def test_a_full_checkpoint_under_lora_is_named(tmp_path):
    checkpoint(tmp_path, None)
    check_base(tmp_path, None, None)  # control: full fine-tuning resumes full fine-tuning
    with pytest.raises(
        ValueError, match=r"global_step1' is a full fine-tuning one \(no lora_base\.json\)"
    ):
        check_base(tmp_path, None, BASE)


def test_another_base_names_both_hashes(tmp_path):
    checkpoint(tmp_path, BASE)
    other = {"model": "tiny-qwen", "hash": "def456"}
    with pytest.raises(
        ValueError,
        match=r"base 'tiny-llama' \(content hash abc123\), but this run's model 'tiny-qwen' has hash def456",
    ):
        check_base(tmp_path, "global_step1", other)
