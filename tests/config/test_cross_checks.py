"""Checks across sections (rl_engine/config/cross_checks.py), each error naming the keys
involved: where prompts and rewards come from (a task, a dataset, a rollout file: one of
them), the token budget against the longest sequence, mini-batches against ranks and
micro-batches, DAPO's buffer and filtering, and what an environment replaces (it rewards and
generates: nothing else may)."""

from __future__ import annotations

import pytest

from rl_engine.config import RunConfig
from rl_engine.config.cross_checks import check_mini_batches, check_run

ENV = "rl_engine.envs.calculator:Calculator"


def config(**sections) -> RunConfig:
    rollout = sections.pop("rollout", {})
    return RunConfig.from_dict({"rollout": {"env": ENV, **rollout}, **sections})


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"reward": {"function": "math"}}, "reward.function cannot be set with rollout.env"),
        ({"rollout": {"source": "r.jsonl"}}, "rollout.source cannot be set with rollout.env"),
        (
            {"algorithm": {"overlong_penalty": {"buffer": 2, "factor": 1.0}}},
            "algorithm.overlong_penalty cannot be set with rollout.env",
        ),
        ({"rollout": {"task": "my.rewards:score"}}, "rollout.task 'my.rewards:score'"),
        (
            {"rollout": {"max_total_tokens": 16, "max_new_tokens": 16}},
            "rollout.max_total_tokens = 16 must be more than rollout.max_new_tokens = 16",
        ),
    ],
)
def test_what_an_environment_replaces_cannot_be_set_beside_it(sections, message):
    with pytest.raises(ValueError, match=message):
        config(**sections)


def test_prompts_still_come_from_a_task_or_a_dataset():
    assert config(rollout={"task": "arithmetic"}).rollout.task == "arithmetic"
    assert config(rollout={"task": "jsonl:q.jsonl"}).rollout.task == "jsonl:q.jsonl"
    assert config(data={"train_files": "q.jsonl"}).data.train_files == ["q.jsonl"]


def test_the_token_budget_holds_a_whole_episode():
    ok = config(rollout={"max_total_tokens": 96}, trainer={"max_tokens_per_micro_batch": 96})
    assert ok.trainer.max_tokens_per_micro_batch == 96
    with pytest.raises(
        ValueError,
        match="trainer.max_tokens_per_micro_batch = 95 is less than rollout.max_total_tokens = 96",
    ):
        config(rollout={"max_total_tokens": 96}, trainer={"max_tokens_per_micro_batch": 95})
    # without an environment the rule is the single completion's, as before
    plain = RunConfig.from_dict({"trainer": {"max_tokens_per_micro_batch": 17}})
    assert plain.trainer.max_tokens_per_micro_batch == 17


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"eval": {"every": 2}}, "eval.every needs data.val_files"),
        (
            {"data": {"train_files": "a.parquet"}, "rollout": {"task": "arithmetic"}},
            r"data\.train_files and rollout\.task 'arithmetic'",
        ),
        (
            {"reward": {"function": "math"}, "rollout": {"task": "jsonl:p.jsonl"}},
            r"reward\.function and rollout\.task 'jsonl:p\.jsonl'",
        ),
        (
            {"rollout": {"source": "r.jsonl"}, "data": {"train_files": "a.parquet"}},
            "rollout.source and data.train_files both give the training prompts",
        ),
    ],
)
def test_prompts_and_rewards_come_from_one_place(data, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict(data)


def test_the_token_budget_holds_a_completion_and_its_first_prompt_token():
    RunConfig.from_dict({"trainer": {"max_tokens_per_micro_batch": 17}})  # 16 new tokens + 1
    with pytest.raises(
        ValueError,
        match=r"trainer.max_tokens_per_micro_batch = 16 is less than rollout.max_new_tokens \+ 1 = 17",
    ):
        RunConfig.from_dict({"trainer": {"max_tokens_per_micro_batch": 16}})
    # another engine's rollouts carry their own lengths: the budget is checked per batch
    source = {"rollout": {"source": "r.jsonl"}, "trainer": {"max_tokens_per_micro_batch": 4}}
    assert RunConfig.from_dict(source).trainer.max_tokens_per_micro_batch == 4


@pytest.mark.parametrize(
    ("trainer", "message"),
    [
        ({"mini_batch_size": 32}, "trainer.mini_batch_size = 32 must divide"),
        ({"mini_batch_size": 6}, "trainer.mini_batch_size = 6 must divide"),
        (
            {"mini_batch_size": 4, "num_ranks": 8, "micro_batch_size": 1},
            "must be a multiple of trainer.num_ranks = 8",
        ),
        (
            {"mini_batch_size": 8, "num_ranks": 2, "micro_batch_size": 3},
            "trainer.mini_batch_size / trainer.num_ranks = 4 must be a multiple of trainer.micro_batch_size = 3",
        ),
    ],
)
def test_mini_batches_split_evenly_over_ranks_and_micro_batches(trainer, message):
    with pytest.raises(ValueError, match=message):
        RunConfig.from_dict({"trainer": trainer})


def test_a_token_budget_frees_mini_batches_from_the_micro_batch_size():
    trainer = {"mini_batch_size": 8, "num_ranks": 2, "micro_batch_size": 3}
    config = RunConfig.from_dict({"trainer": {**trainer, "max_tokens_per_micro_batch": 64}})
    check_mini_batches(config)
    assert config.mini_batches_per_step == 2


def test_dapo_buffer_and_filtering_fit_the_rollout():
    penalty = {"overlong_penalty": {"buffer": 17, "factor": 1.0}}
    with pytest.raises(
        ValueError, match="overlong_penalty.buffer = 17 is more than rollout.max_new_tokens = 16"
    ):
        RunConfig.from_dict({"algorithm": penalty})
    with pytest.raises(ValueError, match="rollout.filter_groups samples more prompts"):
        RunConfig.from_dict({"rollout": {"filter_groups": True, "source": "r.jsonl"}})


def test_layout_invariance_refuses_the_plain_kernels_naming_the_key():
    with pytest.raises(
        ValueError, match="trainer.layout_invariant: true does not serve batch_invariant"
    ):
        RunConfig.from_dict(
            {"trainer": {"layout_invariant": True}, "batch_invariant": False, "parity": "off"}
        )
    assert RunConfig.from_dict({"trainer": {"layout_invariant": True}}).trainer.layout_invariant


def test_check_run_accepts_the_defaults_and_sees_a_section_changed_after_construction():
    config = RunConfig()
    check_run(config)
    config.eval.every = 3  # sections are mutable: the run check is what catches the clash
    with pytest.raises(ValueError, match="eval.every needs data.val_files"):
        check_run(config)


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"batch_invariant": False, "parity": "report"}, "batch_invariant: false"),
        ({"lora": {"rank": 4}}, "lora"),
        ({"rollout": {"engine": "vllm", "env": ENV}}, "rollout.env"),
        (
            {"rollout": {"engine": "vllm", "tensor_parallel_size": 2}},
            "rollout.tensor_parallel_size: 2",
        ),
        ({"device": "cuda"}, "device: cuda"),
    ],
)
def test_the_vllm_engine_refuses_what_it_cannot_keep_exact_by_name(data, named):
    rollout = {"engine": "vllm", **data.pop("rollout", {})}
    with pytest.raises(ValueError, match=f"rollout.engine: vllm does not support {named}"):
        RunConfig.from_dict({"rollout": rollout, **data})


def test_the_vllm_engine_without_vllm_says_how_to_install_it(monkeypatch):
    """The machine-without-vLLM path (vLLM is installed here: its absence is simulated)."""
    from rl_engine.rollout import vllm as plugin

    monkeypatch.setattr(plugin, "installed", lambda: False)
    with pytest.raises(ValueError, match=r"rollout.engine: vllm: .*make setup installs it"):
        RunConfig.from_dict({"rollout": {"engine": "vllm"}})
    assert RunConfig.from_dict({}).rollout.engine == "own"  # the own engine stays the default


NGRAM = {"method": "ngram", "num_tokens": 3}


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"batch_invariant": False, "parity": "report"}, "batch_invariant: false"),
        ({"rollout": {"engine": "vllm"}}, "rollout.engine: vllm"),
    ],
)
def test_speculation_refuses_what_it_cannot_keep_exact_by_name(data, named):
    rollout = {"speculative": NGRAM, **data.pop("rollout", {})}
    with pytest.raises(ValueError, match=f"rollout.speculative does not support {named}"):
        RunConfig.from_dict({"rollout": rollout, **data})


def test_speculation_keys_are_checked_and_round_trip():
    with pytest.raises(ValueError, match="rollout.speculative.num_tokens"):
        RunConfig.from_dict({"rollout": {"speculative": {"method": "ngram", "num_tokens": 0}}})
    config = RunConfig.from_dict({"rollout": {"speculative": NGRAM}})
    assert config.rollout.speculative_params.num_tokens == 3
    assert RunConfig.from_dict(config.to_dict()).rollout.speculative == NGRAM
    assert RunConfig().rollout.speculative_params is None


def test_asynchronous_rollouts_need_generation_and_round_trip(tmp_path):
    with pytest.raises(ValueError, match="rollout.max_staleness does not support rollout.source"):
        RunConfig.from_dict({"rollout": {"max_staleness": 1, "source": str(tmp_path)}})
    config = RunConfig.from_dict({"rollout": {"max_staleness": 2, "async_order": "free"}})
    again = RunConfig.from_dict(config.to_dict()).rollout
    assert (again.max_staleness, again.async_order) == (2, "free")
    default = RunConfig().rollout
    assert (default.max_staleness, default.async_order) == (0, "deterministic")
