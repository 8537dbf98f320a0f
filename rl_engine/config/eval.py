"""The `eval:` section: validation during training (executors/job/evaluation.py)."""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.base.fields import check_bool, check_int, check_number


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Validation on data.val_files with the rollout engines: at step 0, every N steps, at the end."""

    every: int = 0
    """Evaluate after every this many steps (0: only at step 0 and after the last step)."""
    samples_per_prompt: int = 1
    """k: completions per validation prompt (pass@k and mean@k are over these k)."""
    temperature: float = 0.0
    """Sampling temperature of validation (0 = greedy)."""
    max_new_tokens: int | None = None
    """Most tokens per validation completion (null: rollout.max_new_tokens)."""
    before_train: bool = True
    """Evaluate the initial policy too (its figures go into step 0's row)."""

    def __post_init__(self) -> None:
        check_int("eval.every", self.every, 0)
        check_int("eval.samples_per_prompt", self.samples_per_prompt, 1)
        check_number("eval.temperature", self.temperature, low=0.0)
        if self.max_new_tokens is not None:
            check_int("eval.max_new_tokens", self.max_new_tokens, 1)
        check_bool("eval.before_train", self.before_train)
