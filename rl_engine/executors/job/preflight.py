"""Everything the driver can check before it starts Ray: each problem is one line, exit code 2.

A mistake found here costs the user a second; found inside an actor it costs a Ray
start-up and a 50-line remote traceback.
"""

from __future__ import annotations

from rl_engine.config import RunConfig


def validate_before_start(config: RunConfig) -> None:
    """Model spec resolvable, DeepSpeed config readable with a valid stage, batch divisible,
    task known and its reward function importable / prompt file valid. Raises ValueError."""
    from rl_engine.executors.worker.ds_config import build_deepspeed_config
    from rl_engine.models import check_model_spec, has_tokenizer
    from rl_engine.tasks import check_task_spec

    try:
        check_model_spec(config.model)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        raise ValueError(f"model: {err}") from None
    config.gradient_accumulation_steps  # noqa: B018 - raises when the batch does not divide
    ds = build_deepspeed_config(config, config.trainer.num_ranks)
    stage = ds["zero_optimization"].get("stage")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(
            f"trainer.deepspeed: zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}"
        )
    check_task_spec(config.rollout.task)
    task = config.rollout.task
    needs_tokenizer = task == "arithmetic" or task.startswith("jsonl:")
    if needs_tokenizer and not has_tokenizer(config.model):
        raise ValueError(
            f"rollout.task {task!r} needs a model with a tokenizer; model {config.model!r} has none "
            "(e.g. use smollm2-135m-instruct)"
        )
