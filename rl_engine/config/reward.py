"""The `reward:` section: the reward function (rl_engine.rewards) and its Ray workers."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_engine.base.fields import check_choice, check_int, check_number, check_text, fail

REWARD_ERRORS = ("zero", "fail")


@dataclass(kw_only=True, slots=True)
class RewardConfig:
    """How completions are scored when prompts come from `data` (or `reward.function` is set)."""

    function: str | None = None
    """'math' (math-verify), 'gsm8k' ('#### answer'), 'path/to/file.py:compute_score' or
    'module:function' with verl's signature compute_score(data_source, solution_str,
    ground_truth, extra_info=None) -> float | {'score': float, ...}. null: by data_source
    (gsm8k sources: 'gsm8k', anything else: 'math')."""
    kwargs: dict = field(default_factory=dict)
    """Extra keyword arguments for every call of the function (verl's reward_kwargs)."""
    num_workers: int = 0
    """Ray worker processes that score in parallel (0 = in the driver)."""
    timeout_s: float = 10.0
    """Most seconds one sample's score may take; then it counts as timed out."""
    on_error: str = "zero"
    """A score that raises, times out or is not a number: 'zero' (scored 0, counted in
    reward/errors and reward/timeouts) or 'fail' (the step fails, naming the sample)."""

    def __post_init__(self) -> None:
        if self.function is not None:
            check_text("reward.function", self.function)
        if not isinstance(self.kwargs, dict) or not all(isinstance(k, str) for k in self.kwargs):
            fail("reward.kwargs", "a mapping of argument names to values", self.kwargs)
        check_int("reward.num_workers", self.num_workers, 0)
        check_number("reward.timeout_s", self.timeout_s, low=0.0, low_open=True)
        check_choice("reward.on_error", self.on_error, REWARD_ERRORS)
