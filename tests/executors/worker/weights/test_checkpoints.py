"""Weights out of the worker and checkpoints in (executors/worker/weights/checkpoints.py), on
one rank without ZeRO-3, the tiny Llama (tied embedding and head) in-process: the buckets hold
every tensor once, in order, none over the budget but a tensor larger than it alone; the exported
state dict and the weights file are the policy's tensors bit for bit (CPU copies: a later change
of the policy does not reach them, the control), tied names sharing one; ranks other than 0
export nothing; a checkpoint directory that does not exist is refused by name (the DeepSpeed
checkpoints themselves: critic/test_worker.py, test_critic.py and the job's resume tests)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.weights.checkpoints import (
    export_state_dict,
    gathered_buckets,
    load_checkpoint,
    save_weights_file,
)
from rl_engine.executors.worker.weights.weights_file import read_weights_file
from rl_engine.models import load_model

BUCKET = 64 << 10  # bytes: several buckets, and the embedding (1000 x 96 fp32) alone


@pytest.fixture
def policy():
    model, _ = load_model("tiny-llama", seed=4)
    return model


def test_buckets_hold_every_tensor_once_within_the_budget(policy):
    buckets = list(gathered_buckets(policy, zero3=False, deepspeed=None, bucket_bytes=BUCKET))
    assert len(buckets) > 2
    for bucket in buckets:
        size = sum(t.numel() * t.element_size() for _, t in bucket)
        assert size <= BUCKET or len(bucket) == 1
    names = [n for bucket in buckets for names, _ in bucket for n in names]
    assert sorted(names) == sorted(policy.state_dict())
    tied = [names for bucket in buckets for names, _ in bucket if len(names) > 1]
    assert tied == [("model.embed_tokens.weight", "lm_head.weight")]


def test_the_exported_state_dict_is_the_policys_bits_as_copies(policy):
    state = export_state_dict(policy, zero3=False, rank=0, deepspeed=None, bucket_bytes=BUCKET)
    want = policy.state_dict()
    assert list(state) == list(want)
    assert all(torch.equal(state[n], want[n]) for n in want)
    assert state["lm_head.weight"] is state["model.embed_tokens.weight"]
    with torch.no_grad():
        policy.model.norm.weight.add_(1.0)
    assert not torch.equal(state["model.norm.weight"], policy.model.norm.weight)  # control
    assert (
        export_state_dict(policy, zero3=False, rank=1, deepspeed=None, bucket_bytes=BUCKET) is None
    )


def test_the_weights_file_is_the_policys_bits(policy, tmp_path):
    path = save_weights_file(
        policy, tmp_path / "w.safetensors", zero3=False, rank=0, deepspeed=None, bucket_bytes=BUCKET
    )
    back = read_weights_file(path)
    want = policy.state_dict()
    assert back.keys() == want.keys()
    assert all(torch.equal(back[n], want[n]) for n in want)
    other = save_weights_file(
        policy,
        tmp_path / "r1.safetensors",
        zero3=False,
        rank=1,
        deepspeed=None,
        bucket_bytes=BUCKET,
    )
    assert other is None and not (tmp_path / "r1.safetensors").exists()


def test_a_missing_checkpoint_directory_is_refused(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(ValueError, match=f"checkpoint directory '{missing}' does not exist"):
        load_checkpoint(None, missing, None)
