"""Everything the driver can check before it starts Ray: each problem is one line, exit code 2.

A mistake found here costs the user a second; found inside an actor it costs a Ray
start-up and a 50-line remote traceback.
"""

from __future__ import annotations

from rl_engine.config import RunConfig


def validate_before_start(config: RunConfig) -> None:
    """Model spec resolvable, DeepSpeed config readable with a valid stage, batch divisible,
    task known and its reward function importable / prompt file valid, datasets readable
    with their columns, reward.function loadable, trackers installed. Raises ValueError."""
    from rl_engine.data.tasks import check_task_spec
    from rl_engine.executors.worker.ds_config import build_deepspeed_config
    from rl_engine.executors.worker.policy.setup import check_no_diagnostics_adapter
    from rl_engine.models import check_model_spec, has_tokenizer

    try:
        check_model_spec(config.model)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        raise ValueError(f"model: {err}") from None
    check_no_diagnostics_adapter(config)
    check_tensor_parallel(config)
    check_lora_targets(config)
    config.gradient_accumulation_steps  # noqa: B018 - raises when the batch does not divide
    ds = build_deepspeed_config(config, config.trainer.num_ranks)
    stage = ds["zero_optimization"].get("stage")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(
            f"trainer.deepspeed: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}"
        )
    if config.algorithm.name == "ppo":
        _check_critic(config)
    check_task_spec(config.rollout.task)
    task = config.rollout.task
    needs_tokenizer = task == "arithmetic" or task.startswith("jsonl:")
    if needs_tokenizer and not has_tokenizer(config.model):
        raise ValueError(
            f"rollout.task {task!r} needs a model with a tokenizer; model {config.model!r} has none "
            "(e.g. use smollm2-135m-instruct)"
        )
    check_data(config, has_tokenizer(config.model))
    check_reward(config)
    check_env(config, has_tokenizer(config.model))
    from rl_engine.executors.job.trackers import check_backends

    check_backends(config.logging.backends)


def check_tensor_parallel(config: RunConfig) -> None:
    """rollout.tensor_parallel_size against the model's dimensions (ValueError naming the one
    that does not split: query heads, KV heads; or a mixture-of-experts model)."""
    if config.rollout.tensor_parallel_size == 1:
        return
    from rl_engine.models import model_config
    from rl_engine.rollout.tp import TPLayout

    TPLayout.from_config(model_config(config.model), config.rollout.tensor_parallel_size)


def check_lora_targets(config: RunConfig, model: str | None = None) -> None:
    """lora.target_modules against the linears of `model` (default: the policy's), on a
    weightless (meta) copy of it."""
    if not config.lora.enabled:
        return
    from rl_engine.models.build import meta_skeleton
    from rl_engine.patching.lora import resolve_targets

    resolve_targets(meta_skeleton(model or config.model), config.lora.target_modules)


def check_data(config: RunConfig, tokenizer: bool) -> None:
    """data.train_files / val_files readable, with the configured columns and at least one row."""
    from rl_engine.data import check_dataset

    for key in ("train_files", "val_files"):
        files = getattr(config.data, key)
        if files is None:
            continue
        if not tokenizer:
            raise ValueError(
                f"data.{key} needs a model with a tokenizer (its prompts are text); model "
                f"{config.model!r} has none (e.g. use smollm2-135m-instruct or a HF folder)"
            )
        check_dataset(files, config.data, key=f"data.{key}")


def check_reward(config: RunConfig) -> None:
    """The reward function loads and takes verl's arguments (the built-ins: their package is there)."""
    import importlib.util

    from rl_engine.executors.job.scorers import scores_with_reward_function
    from rl_engine.rewards import load_reward_function

    if not scores_with_reward_function(config):
        return
    spec = config.reward.function
    if spec in (None, "math") and importlib.util.find_spec("math_verify") is None:
        raise ValueError(
            f"reward.function {spec or 'null (by data_source)'!r} scores with math-verify, which is "
            "not installed: pip install 'rl-engine[data]' (or math-verify)"
        )
    load_reward_function(spec, config.reward.kwargs)


def check_env(config: RunConfig, tokenizer: bool) -> None:
    """rollout.env names a class with reset and step; rollout.stop_strings have a tokenizer."""
    if config.rollout.env is None:
        return
    from rl_engine.envs import load_environment

    load_environment(config.rollout.env)
    if config.rollout.stop_strings and not tokenizer:
        raise ValueError(
            f"rollout.stop_strings needs a model with a tokenizer (stop strings are text); model "
            f"{config.model!r} has none"
        )


def _check_critic(config: RunConfig) -> None:
    """The critic's model spec and its DeepSpeed config (its own ranks and ZeRO stage)."""
    from rl_engine.executors.worker.ds_config import build_deepspeed_config
    from rl_engine.models import check_model_spec

    if config.critic.model is not None:
        try:
            check_model_spec(config.critic.model)
            check_lora_targets(config, config.critic.model)  # the critic's own adapter
        except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
            raise ValueError(f"critic.model: {err}") from None
    view = config.critic_view()
    try:
        build_deepspeed_config(view, view.trainer.num_ranks)
    except ValueError as err:
        raise ValueError(f"critic: {err}") from None
