"""The `critic:` section (rl_engine/config/critic.py) and `algorithm.name: ppo`: defaults, the
critic's view of the trainer section, and errors that name their key."""

from __future__ import annotations

import re

import pytest

from rl_engine.config import CriticConfig, RunConfig

PPO = {"algorithm": {"name": "ppo"}}


def test_ppo_without_a_critic_section_gets_the_defaults():
    config = RunConfig.from_dict(PPO)
    assert config.algorithm.advantage == "gae"  # the default estimator under ppo
    assert (config.algorithm.gamma, config.algorithm.lam) == (1.0, 1.0)
    c = config.critic
    assert c.model is None and c.num_ranks is None and c.zero_stage is None
    assert (c.value_clip, c.warmup_steps, c.lr) == (0.5, 0, 1e-5)


def test_critic_view_is_the_trainer_with_the_critics_ranks_stage_and_lr():
    config = RunConfig.from_dict(
        {
            **PPO,
            "rollout": {"prompts_per_step": 2, "samples_per_prompt": 4},
            "trainer": {"num_ranks": 2, "micro_batch_size": 2, "zero_stage": 3, "lr": 1e-6},
            "critic": {"num_ranks": 1, "lr": 1e-4},
        }
    )
    view = config.critic_view()
    assert (view.trainer.num_ranks, view.trainer.zero_stage, view.trainer.lr) == (1, 3, 1e-4)
    assert view.model == config.model and view.sequences_per_rank == 8
    assert view.trainer.micro_batch_size == 2 and config.trainer.num_ranks == 2
    assert RunConfig.from_dict({**PPO, "trainer": {"num_ranks": 2}}).critic_ranks == 2


INVALID = [
    ({"algorithm": {"advantage": "gae"}}, "algorithm.advantage 'gae' needs a critic"),
    ({"algorithm": {"name": "ppo", "advantage": "grpo"}}, "algorithm.advantage 'grpo' does not"),
    ({**PPO, "critic": {"lr": 0}}, "critic.lr must be"),
    ({**PPO, "critic": {"value_clip": 0.0}}, "critic.value_clip must be"),
    ({**PPO, "critic": {"warmup_steps": -1}}, "critic.warmup_steps must be"),
    ({**PPO, "critic": {"num_ranks": 0}}, "critic.num_ranks must be"),
    ({**PPO, "critic": {"zero_stage": 4}}, "critic.zero_stage must be"),
    ({**PPO, "critic": {"model": ""}}, "critic.model must be"),
    ({**PPO, "critic": {"num_ranks": 3}}, "critic.num_ranks = 3 must divide"),
    ({**PPO, "critic": {"value_head": "linear"}}, "unknown config keys: critic.value_head"),
    ({**PPO, "rollout": {"source": "rollouts.jsonl"}}, "algorithm.name 'ppo' needs the critic"),
]


@pytest.mark.parametrize(("data", "message"), INVALID, ids=[m for _, m in INVALID])
def test_bad_critic_keys_name_themselves(data, message):
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        RunConfig.from_dict(data)


def test_the_critic_section_is_ignored_without_ppo():
    config = RunConfig.from_dict({"critic": {"num_ranks": 3, "warmup_steps": 2}})
    assert config.algorithm.name == "grpo" and config.critic.num_ranks == 3


def test_the_section_alone_checks_its_own_keys():
    assert CriticConfig(model="tiny-qwen3", num_ranks=2, zero_stage=3).zero_stage == 3
    with pytest.raises(
        ValueError, match=r"^critic\.zero_stage must be null or one of 0, 1, 2, 3, got 5"
    ):
        CriticConfig(zero_stage=5)
    with pytest.raises(ValueError, match=r"^critic\.lr must be"):
        CriticConfig(lr=float("inf"))
