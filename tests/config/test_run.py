"""RunConfig (rl_engine/config/run.py): the top-level keys' defaults and errors (each names
its key), the sections as typed fields, parity's spellings and default, the step's batch
arithmetic and the critic's view; every YAML file in configs/ loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from rl_engine.config import AlgorithmConfig, RolloutConfig, RunConfig, TrainerConfig
from rl_engine.config.run import DTYPES, SECTIONS


def test_defaults():
    c = RunConfig()
    assert (c.model, c.dtype, c.device, c.batch_invariant, c.parity) == (
        "tiny-llama",
        "float32",
        "cpu",
        True,
        "strict",
    )
    assert c.torch_dtype is torch.float32
    assert (c.rollout.samples_per_prompt, c.rollout.task, c.rollout.top_k) == (4, "count", 0)
    assert c.trainer.deepspeed == {"zero_optimization": {"stage": 0}, "steps_per_print": 1_000_000}
    assert (
        c.trainer.zero_stage is None
        and c.algorithm.name == "grpo"
        and c.algorithm.rollout_correction == "none"
    )
    assert c.sequences_per_step == 16 and c.gradient_accumulation_steps == 4
    assert c.trainer.packing is True and c.trainer.max_tokens_per_micro_batch == 0
    assert RunConfig(dtype="bfloat16").torch_dtype is torch.bfloat16


def test_sections_do_not_share_mutable_defaults():
    a, b = RunConfig(), RunConfig()
    a.trainer.deepspeed["zero_optimization"]["stage"] = 2
    assert b.trainer.deepspeed["zero_optimization"]["stage"] == 0


INVALID = [
    ({"dtype": "float16"}, "dtype"),
    ({"model": ""}, "model"),
    ({"seed": -1}, "seed"),
    ({"device": "cuda:0"}, "device"),
    ({"batch_invariant": "yes"}, "batch_invariant"),
    ({"parity": "loose"}, "parity"),
    ({"output_dir": ""}, "output_dir"),
    ({"steps": 0}, "steps"),
]


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)


def test_strict_parity_needs_invariance():
    with pytest.raises(ValueError, match="parity 'strict' needs batch_invariant"):
        RunConfig(batch_invariant=False)
    assert RunConfig(batch_invariant=False, parity="report").parity == "report"


def test_batch_must_split_into_micro_batches_over_ranks_for_training():
    config = RunConfig(
        rollout=RolloutConfig(prompts_per_step=3, samples_per_prompt=2),
        trainer=TrainerConfig(micro_batch_size=4),
    )
    with pytest.raises(
        ValueError, match="multiple of trainer.micro_batch_size x trainer.num_ranks"
    ):
        config.gradient_accumulation_steps  # noqa: B018 - the property raises


def test_repository_configs_load():
    paths = sorted(Path(__file__).resolve().parents[2].glob("configs/*.yaml"))
    assert "demo.yaml" in [p.name for p in paths], f"configs/demo.yaml not among {paths}"
    for path in paths:
        RunConfig.from_yaml(path)


def test_sections_are_keyword_only_and_typed():
    with pytest.raises(TypeError):
        AlgorithmConfig("grpo")  # kw_only
    with pytest.raises(ValueError, match="rollout must be a RolloutConfig"):
        RunConfig(rollout={"max_new_tokens": 4})


@pytest.mark.parametrize("text", ["off", "false", "'off'"])
def test_parity_off_spellings_in_yaml(tmp_path, text):
    """YAML 1.1 reads an unquoted `off` as false; every spelling means parity 'off'."""
    path = tmp_path / "run.yaml"
    path.write_text(f"batch_invariant: false\nparity: {text}\n")
    assert RunConfig.from_yaml(path).parity == "off"
    with pytest.raises(ValueError, match="parity must be one of"):
        RunConfig(parity=True)


def test_parity_defaults_to_report_on_another_engines_rollouts():
    """Another engine's logprobs are rarely bitwise equal: rollout.source makes 'report' the default."""
    assert RunConfig().parity == "strict"
    assert RunConfig.from_dict({"rollout": {"source": "r.jsonl"}}).parity == "report"
    assert RunConfig.from_dict({"rollout": {"source": "r.jsonl"}, "parity": "off"}).parity == "off"


def test_adapter_is_optional_text():
    assert RunConfig().adapter is None and RunConfig(adapter="out/adapter").adapter == "out/adapter"
    with pytest.raises(ValueError, match="^adapter must be"):
        RunConfig(adapter="")


def test_every_section_is_a_field_of_its_class_and_round_trips_as_a_dict():
    config = RunConfig()
    assert all(isinstance(getattr(config, name), cls) for name, cls in SECTIONS.items())
    assert set(SECTIONS) <= set(config.to_dict())
    assert RunConfig.from_dict({n: config.to_dict()[n] for n in SECTIONS}) == config
    assert {RunConfig(dtype=name).torch_dtype for name in DTYPES} == set(DTYPES.values())


def test_mini_batches_split_the_step_into_optimizer_steps_per_rank():
    """16 sequences a step over 2 ranks, mini-batches of 8: 2 updates an epoch, each rank's 4
    sequences of a mini-batch in micro-batches of 2."""
    config = RunConfig.from_dict(
        {"trainer": {"num_ranks": 2, "micro_batch_size": 2, "mini_batch_size": 8}}
    )
    assert (config.sequences_per_step, config.sequences_per_rank) == (16, 8)
    assert (config.mini_batches_per_step, config.mini_batch_per_rank) == (2, 4)
    assert config.gradient_accumulation_steps == 2


def test_a_token_budget_makes_the_micro_batch_count_the_workers():
    """Under a token budget the worker marks each mini-batch's last micro-batch: DeepSpeed's
    accumulation count is 1, and the step need only split over the ranks."""
    budget = {"trainer": {"max_tokens_per_micro_batch": 64, "micro_batch_size": 3}}
    assert RunConfig.from_dict(budget).gradient_accumulation_steps == 1
    trainer = {**budget["trainer"], "num_ranks": 2}
    odd = RunConfig.from_dict(
        {"trainer": trainer, "rollout": {"prompts_per_step": 3, "samples_per_prompt": 1}}
    )
    with pytest.raises(
        ValueError, match="= 3 sequences per step must be a multiple of trainer.num_ranks = 2"
    ):
        odd.sequences_per_rank  # noqa: B018 - the property raises


def test_from_yaml_applies_the_overrides_after_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("steps: 3\ntrainer: {lr: 1.0e-4}\n")
    config = RunConfig.from_yaml(path, ["trainer.lr=2e-5", "model=tiny-qwen3"])
    assert (config.steps, config.trainer.lr, config.model) == (3, 2e-5, "tiny-qwen3")
