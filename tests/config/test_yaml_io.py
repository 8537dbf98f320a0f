"""The run config as text (rl_engine/config/yaml_io.py): YAML in and out (a round trip gives
the same config, an empty file the defaults, '1e-5' reads as a float), `--set key=value`
overrides, unknown keys listed with their section and the valid keys, and errors that name
the file, line and column, the override or the section."""

from __future__ import annotations

import dataclasses

import pytest

from rl_engine.config import RunConfig
from rl_engine.config.yaml_io import apply_overrides, check_keys, read_yaml, write_yaml


def test_yaml_round_trip(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        "model: tiny-qwen3\ndtype: bfloat16\nparity: report\nbatch_invariant: false\n"
        "rollout: {samples_per_prompt: 2, temperature: 0.7}\n"
        "trainer: {num_ranks: 2, micro_batch_size: 2, zero_stage: 3, deepspeed: configs/deepspeed/zero3.json}\n"
        "algorithm: {name: grpo, kl_coef: 0.1, rollout_correction: token_truncate, loss_aggregation: seq-mean-token-mean}\n"
    )
    config = RunConfig.from_yaml(path)
    assert (
        config.rollout.temperature == 0.7
        and config.trainer.zero_stage == 3
        and config.algorithm.rollout_correction == "token_truncate"
    )
    config.to_yaml(tmp_path / "again.yaml")
    assert RunConfig.from_yaml(tmp_path / "again.yaml") == config
    assert RunConfig.from_dict(dataclasses.asdict(config)) == config


def test_empty_yaml_gives_defaults(tmp_path):
    (tmp_path / "empty.yaml").write_text("")
    assert RunConfig.from_yaml(tmp_path / "empty.yaml") == RunConfig()


def test_unknown_keys_are_listed_with_their_section():
    with pytest.raises(ValueError) as err:
        RunConfig.from_dict(
            {"modle": "x", "trainer": {"lr": 1e-4, "micro_batch": 2}, "rollout": {"topk": 3}}
        )
    message = str(err.value)
    assert "modle" in message and "trainer.micro_batch" in message and "rollout.topk" in message
    assert "micro_batch_size" in message  # the valid keys are listed


def test_section_must_be_a_mapping():
    with pytest.raises(ValueError, match="trainer must be a mapping"):
        RunConfig.from_dict({"trainer": [1, 2]})


def test_a_float_without_a_dot_reads_as_a_float(tmp_path):
    """YAML 1.1 wants '1.0e-5'; users write '1e-5' too, and mean the same number."""
    path = tmp_path / "c.yaml"
    path.write_text("a: 1e-5\nb: 1.0e-5\nc: .5\nd: 3\ne: '1e-5'\n")
    assert read_yaml(path) == {"a": 1e-5, "b": 1e-5, "c": 0.5, "d": 3, "e": "1e-5"}


def test_a_missing_file_and_a_syntax_error_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"config file '.*nope\.yaml' does not exist"):
        read_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("steps: 3\ntrainer: {lr: 1\n")
    with pytest.raises(ValueError, match=r"bad\.yaml:3:1: YAML syntax error"):
        read_yaml(bad)


def test_write_yaml_keeps_the_key_order_and_reads_back(tmp_path):
    data = {"steps": 2, "model": "tiny-llama", "trainer": {"lr": 1e-05}}
    write_yaml(tmp_path / "out.yaml", data)
    assert read_yaml(tmp_path / "out.yaml") == data
    assert (tmp_path / "out.yaml").read_text().splitlines()[0] == "steps: 2"
    assert [p.name for p in tmp_path.iterdir()] == ["out.yaml"]  # no temporary file left


def test_overrides_set_dotted_keys_as_yaml_values_on_a_copy():
    data = {"trainer": {"lr": 1e-4}}
    out = apply_overrides(
        data, ["trainer.lr=1e-5", "rollout.top_k=3", "model=x", "critic.model=null"]
    )
    assert out == {
        "trainer": {"lr": 1e-5},
        "rollout": {"top_k": 3},
        "model": "x",
        "critic": {"model": None},
    }
    assert data == {"trainer": {"lr": 1e-4}}  # the caller's dict is not changed
    assert apply_overrides({}, ["a.b.c=[1, 2]"]) == {"a": {"b": {"c": [1, 2]}}}


@pytest.mark.parametrize(
    ("item", "message"),
    [
        ("trainer.lr", r"--set 'trainer.lr': expected key=value with a dotted key"),
        ("=3", r"--set '=3': expected key=value"),
        ("trainer..lr=1", r"--set 'trainer..lr=1': expected key=value"),
        ("trainer.lr=[1", r"--set 'trainer.lr=\[1': the value is not valid YAML"),
        ("steps.x=1", r"--set 'steps.x=1': steps is not a section"),
    ],
)
def test_a_bad_override_names_itself(item, message):
    with pytest.raises(ValueError, match=message):
        apply_overrides({"steps": 3}, [item])


def test_the_config_must_be_a_mapping():
    with pytest.raises(ValueError, match="^config must be a mapping"):
        apply_overrides([1], [])
    with pytest.raises(ValueError, match="^config must be a mapping"):
        check_keys("steps: 3", RunConfig, {})


def test_check_keys_lists_every_unknown_key_of_every_section_at_once():
    @dataclasses.dataclass
    class Top:
        a: int = 0
        s: dict | None = None  # the section, a field of the top class as in RunConfig

    @dataclasses.dataclass
    class Section:
        b: int = 0

    check_keys({"a": 1, "s": {"b": 2}}, Top, {"s": Section})
    with pytest.raises(ValueError) as err:
        check_keys({"x": 1, "s": {"b": 2, "y": 3}}, Top, {"s": Section})
    assert str(err.value) == "unknown config keys: x (valid: a, s), s.y (valid: b)"
