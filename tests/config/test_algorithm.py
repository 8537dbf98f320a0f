"""The `algorithm:` section (rl_engine/config/algorithm.py): one ValueError per invalid key
naming it; the estimator's default follows the loss ('grpo' / 'gae'), 'gae' only with ppo's
critic and ppo only with 'gae'; DAPO's overlong penalty as {buffer, factor}; an episode's
turn reward 'sum' or 'last'."""

from __future__ import annotations

import re

import pytest

from rl_engine.algorithms import ADVANTAGE_ESTIMATORS
from rl_engine.config import ALGORITHMS, AlgorithmConfig, RunConfig

ENV = "rl_engine.envs.calculator:Calculator"

INVALID = [
    ({"algorithm": {"name": "reinforce"}}, "algorithm.name"),
    ({"algorithm": {"clip_eps": 1.0}}, "algorithm.clip_eps"),
    ({"algorithm": {"clip_eps_high": -0.1}}, "algorithm.clip_eps_high"),
    ({"algorithm": {"kl_coef": -1}}, "algorithm.kl_coef"),
    ({"algorithm": {"loss_aggregation": "sum"}}, "algorithm.loss_aggregation"),
    ({"algorithm": {"correction_threshold": 0.5}}, "algorithm.correction_threshold"),
    ({"algorithm": {"normalize_std": 1}}, "algorithm.normalize_std"),
    ({"algorithm": {"advantage": "vtrace"}}, "algorithm.advantage"),
    ({"algorithm": {"gamma": 1.5}}, "algorithm.gamma"),
    ({"algorithm": {"lam": -0.1}}, "algorithm.lam"),
    ({"algorithm": {"ratio_level": "batch"}}, "algorithm.ratio_level"),
    ({"algorithm": {"rollout_correction": "clip"}}, "algorithm.rollout_correction"),
    ({"algorithm": {"router_aux_loss_coef": -0.01}}, "algorithm.router_aux_loss_coef"),
    ({"algorithm": {"overlong_penalty": {"buffer": 2}}}, "algorithm.overlong_penalty"),
    (
        {"algorithm": {"overlong_penalty": {"buffer": 0, "factor": 1}}},
        "algorithm.overlong_penalty.buffer",
    ),
    (
        {"algorithm": {"overlong_penalty": {"buffer": 2, "factor": -1}}},
        "algorithm.overlong_penalty.factor",
    ),
]


@pytest.mark.parametrize(("data", "field"), INVALID, ids=[f for _, f in INVALID])
def test_each_invalid_field_names_itself(data, field):
    with pytest.raises(ValueError, match="^" + re.escape(f"{field} must be")):
        RunConfig.from_dict(data)


def config(**sections) -> RunConfig:
    """A run with an environment (the calculator) and the given sections."""
    rollout = sections.pop("rollout", {})
    return RunConfig.from_dict({"rollout": {"env": ENV, **rollout}, **sections})


def test_turn_reward_is_sum_or_last():
    assert config(algorithm={"turn_reward": "last"}).algorithm.turn_reward == "last"
    with pytest.raises(ValueError, match=r"algorithm.turn_reward must be one of \['sum', 'last'\]"):
        config(algorithm={"turn_reward": "mean"})


def test_the_estimator_defaults_to_the_losss_own():
    assert AlgorithmConfig().advantage == "grpo"
    assert AlgorithmConfig(name="ppo").advantage == "gae"
    assert set(ALGORITHMS) == {"grpo", "ppo"} and "gae" in ADVANTAGE_ESTIMATORS
    for estimator in set(ADVANTAGE_ESTIMATORS) - {"gae"}:
        assert AlgorithmConfig(advantage=estimator).advantage == estimator


def test_the_critic_and_gae_come_together():
    with pytest.raises(
        ValueError, match=r"^algorithm\.advantage 'gae' needs a critic .* 'grpo' has none"
    ):
        AlgorithmConfig(advantage="gae")
    with pytest.raises(ValueError, match=r"^algorithm\.advantage 'rloo' does not use the critic"):
        AlgorithmConfig(name="ppo", advantage="rloo")


def test_the_overlong_penalty_is_off_or_a_buffer_and_a_factor():
    assert AlgorithmConfig().overlong_penalty is None
    penalty = {"buffer": 4, "factor": 1.0}
    assert AlgorithmConfig(overlong_penalty=penalty).overlong_penalty == penalty
    with pytest.raises(ValueError, match=r"\{buffer: int, factor: number\}, got 3"):
        AlgorithmConfig(overlong_penalty=3)
