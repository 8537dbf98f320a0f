"""The run's DeepSpeed config (executors/worker/ds_config.py): the user's config completed with
batch sizes, clipping and bf16 from the run config; every contradiction or unsupported key is a
ValueError that names the key and both values."""

from __future__ import annotations

import json

import pytest

from rl_engine.config import RunConfig
from rl_engine.executors.worker.ds_config import build_deepspeed_config, load_deepspeed_config


def run_config(deepspeed: dict | str | None = None, **top) -> RunConfig:
    data: dict = dict(top)
    if deepspeed is not None:
        data["trainer"] = {"deepspeed": deepspeed}
    return RunConfig.from_dict(data)


def test_fills_batch_sizes_clipping_and_bf16_from_the_run_config():
    config = run_config()
    ds = build_deepspeed_config(config, config.trainer.num_ranks)
    micro, accum = config.trainer.micro_batch_size, config.gradient_accumulation_steps
    assert ds["train_micro_batch_size_per_gpu"] == micro
    assert ds["gradient_accumulation_steps"] == accum
    assert ds["train_batch_size"] == micro * accum * config.trainer.num_ranks
    assert ds["bf16"]["enabled"] is (config.dtype == "bfloat16")
    assert ds["zero_optimization"]["stage"] in (0, 1, 2, 3)


def test_a_world_size_unlike_num_ranks_is_named():
    config = run_config()
    with pytest.raises(
        ValueError, match=rf"trainer.num_ranks={config.trainer.num_ranks} but WORLD_SIZE=7"
    ):
        build_deepspeed_config(config, 7)


def test_a_contradicting_batch_size_names_the_key_and_both_values():
    config = run_config()
    micro = config.trainer.micro_batch_size
    agreeing = run_config({"train_micro_batch_size_per_gpu": micro})
    assert build_deepspeed_config(agreeing, 1)["train_micro_batch_size_per_gpu"] == micro  # control
    bad = run_config({"train_micro_batch_size_per_gpu": micro + 1})
    with pytest.raises(
        ValueError, match=rf"deepspeed.train_micro_batch_size_per_gpu = {micro + 1} contradicts"
    ):
        build_deepspeed_config(bad, 1)


@pytest.mark.parametrize(
    ("user", "named"),
    [
        ({"optimizer": {"type": "Adam"}}, "deepspeed.optimizer is not supported"),
        ({"scheduler": {"type": "WarmupLR"}}, "deepspeed.scheduler is not supported"),
        ({"fp16": {"enabled": True}}, "deepspeed.fp16.enabled: fp16 is not supported"),
        (
            {"zero_optimization": {"reduce_bucket_size": "auto"}},
            "deepspeed.zero_optimization.reduce_bucket_size is 'auto'",
        ),
        ({"zero_optimization": 3}, "deepspeed.zero_optimization must be an object, got 3"),
        ({"bf16": {"enabled": "yes"}}, "deepspeed.bf16.enabled must be true or false, got 'yes'"),
    ],
)
def test_unsupported_keys_are_named(user, named):
    with pytest.raises(ValueError, match=named.replace(".", r"\.").replace("(", r"\(")):
        build_deepspeed_config(run_config(user), 1)


def test_bf16_must_agree_with_dtype():
    with pytest.raises(
        ValueError, match=r"deepspeed\.bf16\.enabled is True but dtype is 'float32'"
    ):
        build_deepspeed_config(run_config({"bf16": {"enabled": True}}, dtype="float32"), 1)


def test_load_reads_a_json_file_and_names_a_bad_path(tmp_path):
    good = tmp_path / "ds.json"
    good.write_text(json.dumps({"steps_per_print": 5}))
    assert load_deepspeed_config(str(good)) == {"steps_per_print": 5}
    user = {"zero_optimization": {"stage": 2}}
    copy = load_deepspeed_config(user)
    copy["zero_optimization"]["stage"] = 3
    assert user["zero_optimization"]["stage"] == 2  # a deep copy: the user's dict is untouched
    with pytest.raises(
        ValueError,
        match=r"trainer\.deepspeed: DeepSpeed config file '.*missing\.json' does not exist",
    ):
        load_deepspeed_config(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ValueError, match=r"'.*bad\.json' is not valid JSON"):
        load_deepspeed_config(str(tmp_path / "bad.json"))
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match=r"'.*list\.json' must hold a JSON object"):
        load_deepspeed_config(str(tmp_path / "list.json"))
