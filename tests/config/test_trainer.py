"""The `trainer:` section (rl_engine/config/trainer.py): its defaults, one ValueError per invalid
key naming it and showing the value, the ZeRO stage check it shares with the critic, the
token budget's ragged micro-batches, the weight-sync bucket in bytes, and ZeRO-3's host-memory
defaults under the user's own DeepSpeed values."""

from __future__ import annotations

import re

import pytest

from rl_engine.config import RunConfig, TrainerConfig
from rl_engine.config.trainer import ZERO_STAGES, check_zero_stage

INVALID = [
    ({"trainer": {"num_ranks": 0}}, "trainer.num_ranks"),
    ({"trainer": {"micro_batch_size": 0}}, "trainer.micro_batch_size"),
    ({"trainer": {"packing": 1}}, "trainer.packing"),
    ({"trainer": {"max_tokens_per_micro_batch": 2.5}}, "trainer.max_tokens_per_micro_batch"),
    ({"trainer": {"lr": 0}}, "trainer.lr"),
    ({"trainer": {"weight_decay": -0.1}}, "trainer.weight_decay"),
    ({"trainer": {"grad_clip": float("nan")}}, "trainer.grad_clip"),
    ({"trainer": {"deepspeed": 3}}, "trainer.deepspeed"),
    ({"trainer": {"zero_stage": 4}}, "trainer.zero_stage"),
    ({"trainer": {"placement": "anywhere"}}, "trainer.placement"),
    ({"trainer": {"collective_timeout_s": 0}}, "trainer.collective_timeout_s"),
    ({"trainer": {"weight_sync_bucket_mb": 0}}, "trainer.weight_sync_bucket_mb"),
    ({"trainer": {"mini_batch_size": -1}}, "trainer.mini_batch_size"),
    ({"trainer": {"epochs": 0}}, "trainer.epochs"),
    ({"trainer": {"parity_scope": "some"}}, "trainer.parity_scope"),
    ({"trainer": {"deepspeed": ""}}, "trainer.deepspeed"),
    ({"trainer": {"layout_invariant": "no"}}, "trainer.layout_invariant"),
    ({"trainer": {"activation_checkpointing": 0}}, "trainer.activation_checkpointing"),
]


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)


def test_error_message_shows_the_value():
    with pytest.raises(ValueError, match=r"trainer\.micro_batch_size must be an int >= 1, got 0"):
        TrainerConfig(micro_batch_size=0)


def test_zero3_gets_host_memory_defaults_and_the_users_values_win():
    from rl_engine.executors.worker.ds_config import ZERO3_MEMORY_DEFAULTS, build_deepspeed_config

    plain = RunConfig.from_dict({"trainer": {"zero_stage": 3}})
    zero = build_deepspeed_config(plain, 1)["zero_optimization"]
    assert all(zero[k] == v for k, v in ZERO3_MEMORY_DEFAULTS.items())
    mine = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 123}}
    own = RunConfig.from_dict({"trainer": {"deepspeed": mine}})
    assert build_deepspeed_config(own, 1)["zero_optimization"]["reduce_bucket_size"] == 123
    stage2 = RunConfig.from_dict({"trainer": {"zero_stage": 2}})
    assert not set(ZERO3_MEMORY_DEFAULTS) & set(
        build_deepspeed_config(stage2, 1)["zero_optimization"]
    )


def test_check_zero_stage_takes_null_or_a_stage_and_names_the_key():
    for stage in (None, *ZERO_STAGES):
        check_zero_stage("critic.zero_stage", stage)
    with pytest.raises(
        ValueError, match=r"^critic\.zero_stage must be null or one of 0, 1, 2, 3, got '3'"
    ):
        check_zero_stage("critic.zero_stage", "3")


def test_micro_batches_are_ragged_under_a_token_budget_or_layout_invariance():
    assert not TrainerConfig().ragged_micro_batches
    assert TrainerConfig(max_tokens_per_micro_batch=64).ragged_micro_batches
    assert TrainerConfig(layout_invariant=True).ragged_micro_batches


def test_the_weight_sync_bucket_in_bytes_is_at_least_one():
    assert TrainerConfig().weight_sync_bucket_bytes == 128 * 2**20
    assert TrainerConfig(weight_sync_bucket_mb=0.5).weight_sync_bucket_bytes == 2**19
    assert TrainerConfig(weight_sync_bucket_mb=1e-9).weight_sync_bucket_bytes == 1


def test_a_deepspeed_json_path_is_kept_as_given():
    assert TrainerConfig(deepspeed="configs/deepspeed/zero3.json").deepspeed == (
        "configs/deepspeed/zero3.json"
    )
