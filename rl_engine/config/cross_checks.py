"""Checks that span sections: each section checks its own keys; these check how they fit together.

`check_run(config)` runs them in a fixed order once every section is valid (RunConfig's
`__post_init__`); the first that fails raises a ValueError naming the keys involved.
"""

from __future__ import annotations

from typing import Protocol

from rl_engine.config.algorithm import AlgorithmConfig
from rl_engine.config.data import DataConfig
from rl_engine.config.eval import EvalConfig
from rl_engine.config.lora import LoraConfig
from rl_engine.config.reward import RewardConfig
from rl_engine.config.rollout import RolloutConfig
from rl_engine.config.trainer import TrainerConfig


class RunSections(Protocol):
    """What the checks read of a RunConfig (typed here so that run.py, which calls them, is the
    only one of the two that imports the other)."""

    batch_invariant: bool
    device: str
    rollout: RolloutConfig
    trainer: TrainerConfig
    algorithm: AlgorithmConfig
    data: DataConfig
    reward: RewardConfig
    eval: EvalConfig
    lora: LoraConfig

    @property
    def critic_ranks(self) -> int: ...

    @property
    def sequences_per_step(self) -> int: ...


def check_run(config: RunSections) -> None:
    """Every check across sections, in order; raises at the first that fails."""
    check_prompt_source(config)
    check_token_budget(config)
    check_mini_batches(config)
    check_dapo(config)
    check_critic(config)
    check_env(config)
    check_lora(config)
    check_layout_invariant(config)
    check_vllm_engine(config)
    check_speculative(config)
    check_async(config)


def check_prompt_source(config: RunSections) -> None:
    """data.train_files / reward.function replace rollout.task: setting both is ambiguous."""
    default_task = RolloutConfig().task
    if config.rollout.task != default_task:
        for key, value in (
            ("data.train_files", config.data.train_files),
            ("reward.function", config.reward.function),
        ):
            if value is not None:
                raise ValueError(
                    f"{key} and rollout.task {config.rollout.task!r} both say where prompts or "
                    f"rewards come from; with {key} set, leave rollout.task at its default "
                    f"({default_task!r})"
                )
    if config.rollout.source is not None and config.data.train_files is not None:
        raise ValueError(
            "rollout.source and data.train_files both give the training prompts; set one"
        )
    if config.eval.every and config.data.val_files is None:
        raise ValueError("eval.every needs data.val_files (the prompts to evaluate on)")


def check_token_budget(config: RunSections) -> None:
    """trainer.max_tokens_per_micro_batch must hold one full-length sequence: an episode's
    rollout.max_total_tokens with an environment, else a completion of max_new_tokens."""
    budget = config.trainer.max_tokens_per_micro_batch
    if not budget or config.rollout.source is not None:
        return
    if config.rollout.env is not None:
        longest = config.rollout.max_total_tokens
        if budget < longest:
            raise ValueError(
                f"trainer.max_tokens_per_micro_batch = {budget} is less than "
                f"rollout.max_total_tokens = {longest}: a full-length episode could never fit"
            )
        return
    longest = config.rollout.max_new_tokens + 1
    if budget < longest:
        raise ValueError(
            f"trainer.max_tokens_per_micro_batch = {budget} is less than rollout.max_new_tokens"
            f" + 1 = {longest}: a full-length completion with its prompt could never fit"
        )


def check_mini_batches(config: RunSections) -> None:
    """trainer.mini_batch_size must split the step evenly over the ranks (and micro-batches)."""
    mini, per_step = config.trainer.mini_batch_size, config.sequences_per_step
    if not mini:
        return
    ranks, micro = config.trainer.num_ranks, config.trainer.micro_batch_size
    if mini > per_step or per_step % mini:
        raise ValueError(
            f"trainer.mini_batch_size = {mini} must divide rollout.prompts_per_step x "
            f"rollout.samples_per_prompt = {per_step} sequences per step"
        )
    if mini % ranks:
        raise ValueError(
            f"trainer.mini_batch_size = {mini} must be a multiple of trainer.num_ranks = "
            f"{ranks} (each rank takes mini_batch_size / num_ranks sequences of each)"
        )
    if not config.trainer.ragged_micro_batches and (mini // ranks) % micro:
        raise ValueError(
            f"trainer.mini_batch_size / trainer.num_ranks = {mini // ranks} must be a "
            f"multiple of trainer.micro_batch_size = {micro} (or set "
            "trainer.max_tokens_per_micro_batch)"
        )


def check_dapo(config: RunSections) -> None:
    """The overlong buffer lies within the completion limit; filtering needs generation."""
    penalty, limit = config.algorithm.overlong_penalty, config.rollout.max_new_tokens
    if penalty is not None and penalty["buffer"] > limit:
        raise ValueError(
            f"algorithm.overlong_penalty.buffer = {penalty['buffer']} is more than "
            f"rollout.max_new_tokens = {limit}"
        )
    if config.rollout.filter_groups and config.rollout.source is not None:
        raise ValueError(
            "rollout.filter_groups samples more prompts, which rollout.source cannot: "
            "set one of them"
        )


def check_critic(config: RunSections) -> None:
    """The critic's ranks split the step (and its mini-batches) as the trainer's do."""
    if config.algorithm.name != "ppo":
        return
    if config.rollout.source is not None:
        raise ValueError(
            "algorithm.name 'ppo' needs the critic's values of the policy's own rollouts; "
            "rollout.source trains on another engine's: use name 'grpo' with it"
        )
    ranks, micro = config.critic_ranks, config.trainer.micro_batch_size
    mini = config.trainer.mini_batch_size or config.sequences_per_step
    if mini % ranks:
        raise ValueError(
            f"critic.num_ranks = {ranks} must divide the {mini} sequences of each mini-batch"
        )
    if not config.trainer.ragged_micro_batches and (mini // ranks) % micro:
        raise ValueError(
            f"{mini} sequences per mini-batch / critic.num_ranks = {ranks} must be a multiple "
            f"of trainer.micro_batch_size = {micro} (or set trainer.max_tokens_per_micro_batch)"
        )


def check_env(config: RunSections) -> None:
    """An environment rewards its episodes and generates them: nothing else may do either."""
    r = config.rollout
    if r.env is None:
        return
    task = r.task
    if ":" in task and not task.startswith("jsonl:"):
        raise ValueError(
            f"rollout.env rewards the episodes, so rollout.task {task!r} (a reward over the "
            "built-in prompts) would be ignored; use a built-in task or data.train_files for "
            "the prompts"
        )
    conflicts = (
        ("reward.function", config.reward.function, "the environment's rewards replace it"),
        ("rollout.source", r.source, "episodes are generated with the environment"),
        (
            "algorithm.overlong_penalty",
            config.algorithm.overlong_penalty,
            "it measures one completion against rollout.max_new_tokens",
        ),
    )
    for key, value, why in conflicts:
        if value is not None:
            raise ValueError(f"{key} cannot be set with rollout.env: {why}")
    if r.max_total_tokens <= r.max_new_tokens:
        raise ValueError(
            f"rollout.max_total_tokens = {r.max_total_tokens} must be more than "
            f"rollout.max_new_tokens = {r.max_new_tokens}: an episode holds its prompt and "
            "at least one full turn"
        )


def check_lora(config: RunSections) -> None:
    """A LoRA policy (lora.rank > 0) runs patched, with every algorithm: PPO's critic carries
    an adapter of its own (executors/worker/critic/worker.py); tensor-parallel engines split the
    policy's adapters (rl_engine/rollout/tp/shard_lora.py)."""
    if not config.lora.enabled:
        return
    if not config.batch_invariant:
        raise ValueError(
            "lora.rank > 0 needs batch_invariant: true (the unmerged adapter is computed by the "
            "patched model on both sides)"
        )


# what layout-invariant training does not serve yet: each names the key that turns it off
_LAYOUT_INVARIANT_LIMITS = (
    (
        "batch_invariant",
        lambda c: not c.batch_invariant,
        "needs the invariant kernels: set it true",
    ),
)


def check_layout_invariant(config: RunSections) -> None:
    """trainer.layout_invariant: what its update does not serve yet is refused, naming the key."""
    if not config.trainer.layout_invariant:
        return
    for key, refused, what in _LAYOUT_INVARIANT_LIMITS:
        if refused(config):
            raise ValueError(
                f"trainer.layout_invariant: true does not serve {key} ({what}) yet; "
                f"change {key} or set trainer.layout_invariant: false (docs/usage.md lists what "
                "is served)"
            )


def check_vllm_engine(config: RunSections) -> None:
    """rollout.engine: vllm runs vLLM exact: what that path does not keep exact is refused
    here, by name, and so is a machine without vLLM."""
    if config.rollout.engine != "vllm":
        return
    from rl_engine.rollout import vllm as plugin

    refused = {
        "batch_invariant: false": not config.batch_invariant,
        "device: cuda (the plugin reads vLLM's CPU attention layout)": config.device != "cpu",
        "lora (the adapters are not served by vLLM)": config.lora.enabled,
        "rollout.env (multi-turn episodes)": config.rollout.env is not None,
        f"rollout.tensor_parallel_size: {config.rollout.tensor_parallel_size}": (
            config.rollout.tensor_parallel_size != 1
        ),
    }
    for what, used in refused.items():
        if used:
            raise ValueError(f"rollout.engine: vllm does not support {what}")
    if not plugin.installed():
        raise ValueError(f"rollout.engine: vllm: {plugin.INSTALL_HINT}")


def check_speculative(config: RunSections) -> None:
    """rollout.speculative runs on the own engine (TP engines included), patched."""
    if config.rollout.speculative is None:
        return
    refused = {
        "batch_invariant: false (drafts are verified exactly only by the invariant kernels)": (
            not config.batch_invariant
        ),
        "rollout.engine: vllm (the plugin refuses vLLM's speculative decoding)": (
            config.rollout.engine != "own"
        ),
    }
    for what, used in refused.items():
        if used:
            raise ValueError(f"rollout.speculative does not support {what}")


def check_async(config: RunSections) -> None:
    """rollout.max_staleness >= 1 needs rollouts the engines generate while the ranks train."""
    if config.rollout.max_staleness and config.rollout.source is not None:
        raise ValueError(
            "rollout.max_staleness does not support rollout.source (the rollouts are read, "
            "not generated: nothing runs beside training); set rollout.max_staleness: 0"
        )
