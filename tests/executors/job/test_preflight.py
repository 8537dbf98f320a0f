"""The checks made before Ray starts, called directly: each problem is a ValueError naming the
config key and the bad value (the model spec, a tensor-parallel size the heads do not split
by, LoRA targets the model lacks, a ZeRO stage, a prompt file, text-only features on a model
without a tokenizer); a valid config passes."""

from __future__ import annotations

import json

import pytest

from rl_engine.config import RunConfig
from rl_engine.executors.job.preflight import (
    check_data,
    check_env,
    check_lora_targets,
    check_tensor_parallel,
    validate_before_start,
)


def test_the_default_config_passes():
    validate_before_start(RunConfig())


def test_an_unknown_model_is_prefixed_with_its_key():
    with pytest.raises(ValueError, match=r"^model: unknown model spec 'tiny-llamma'; valid names"):
        validate_before_start(RunConfig.from_dict({"model": "tiny-llamma"}))


def test_a_tensor_parallel_size_that_does_not_split_the_heads_is_named():
    check_tensor_parallel(RunConfig.from_dict({"rollout": {"tensor_parallel_size": 2}}))
    with pytest.raises(ValueError, match=r"tensor_parallel_size 4: .*num_attention_heads 6"):
        check_tensor_parallel(RunConfig.from_dict({"rollout": {"tensor_parallel_size": 4}}))


def test_lora_targets_the_model_lacks_are_named_with_those_it_has():
    with pytest.raises(ValueError, match=r"lora.target_modules: \['nope_proj'\] match no linear"):
        check_lora_targets(
            RunConfig.from_dict({"lora": {"rank": 4, "target_modules": ["nope_proj"]}})
        )
    check_lora_targets(RunConfig.from_dict({"lora": {"rank": 4, "target_modules": ["q_proj"]}}))


def test_an_invalid_zero_stage_is_named(tmp_path):
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 5}}))
    with pytest.raises(ValueError, match=r"zero_optimization.stage must be 0, 1, 2 or 3, got 5"):
        validate_before_start(RunConfig.from_dict({"trainer": {"deepspeed": str(ds)}}))


def test_a_missing_prompt_file_is_named():
    with pytest.raises(
        ValueError, match=r"rollout.task 'jsonl:/no/such.jsonl': file '/no/such.jsonl'"
    ):
        validate_before_start(RunConfig.from_dict({"rollout": {"task": "jsonl:/no/such.jsonl"}}))


def test_text_features_need_a_tokenizer():
    config = RunConfig.from_dict({"data": {"train_files": "train.jsonl"}})
    with pytest.raises(
        ValueError, match=r"data.train_files needs a model with a tokenizer.*'tiny-llama'"
    ):
        check_data(config, tokenizer=False)
    env = RunConfig.from_dict(
        {"rollout": {"env": "rl_engine.envs.guess_number:GuessNumber", "stop_strings": ["</a>"]}}
    )
    with pytest.raises(ValueError, match=r"rollout.stop_strings needs a model with a tokenizer"):
        check_env(env, tokenizer=False)
    check_env(RunConfig(), tokenizer=False)  # no environment: nothing to check
