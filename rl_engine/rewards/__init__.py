"""Reward functions in verl's form: compute_score(data_source, solution_str, ground_truth, extra_info).

- `load_reward_function(spec, kwargs)`: `reward.function` -> callable; `load_function`: the
  one loader of a user's `module:name` / `path.py:name` plug-in, `rollout.task`'s too, and
  `load_class` its sibling for `rollout.env`'s class (`loading`);
- built-ins `math` (math-verify) and `gsm8k` (`#### answer`);
- `call_score` / `Score`: one sample under a time limit, failures counted not raised
  (`scoring`); the Ray worker pool around it lives in executors/job/reward_workers.py.
"""

from rl_engine.rewards.loading import (
    BUILTINS,
    RewardSpecError,
    load_class,
    load_function,
    load_reward_function,
)
from rl_engine.rewards.scoring import (
    RewardFailure,
    RewardSample,
    RewardTimeout,
    Score,
    call_score,
    check_scores,
    normalize,
    score_metrics,
)

__all__ = [
    "BUILTINS",
    "RewardFailure",
    "RewardSample",
    "RewardSpecError",
    "RewardTimeout",
    "Score",
    "call_score",
    "check_scores",
    "load_class",
    "load_function",
    "load_reward_function",
    "normalize",
    "score_metrics",
]
