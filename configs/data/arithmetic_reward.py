"""verl-style reward of configs/smollm2_arithmetic.yaml: the completion's final number is the sum.

A verl reward file as verl loads one (custom_reward_function.path): plain Python, no
rl_engine import. The answer counts when it is the last number of the completion or
inside \\boxed{}; a completion cut off before it gives its answer scores 0, so a
policy that answers in few tokens is rewarded over one that talks first.
"""

import re

_BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
_NUMBER = re.compile(r"-?\d+")


def final_answer(text):
    boxed = _BOXED.findall(text)
    if boxed:
        return boxed[-1]
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = final_answer(solution_str)
    correct = answer is not None and int(answer) == int(ground_truth)
    return {"score": 1.0 if correct else 0.0, "answered": float(answer is not None)}
