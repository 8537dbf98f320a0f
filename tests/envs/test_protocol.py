"""The environment protocol: loading `rollout.env` (one loader with reward plug-ins), and each
call under the time limit, its failures counted rather than raised."""

from __future__ import annotations

import time

import pytest

from rl_engine.envs import call_env, load_environment
from rl_engine.envs.protocol import check_step
from rl_engine.rewards import RewardSpecError, load_function

ENV_FILE = """
class Counter:
    def __init__(self, start=0):
        self.n = start
    def reset(self, record):
        return None
    def step(self, turn):
        self.n += 1
        return [self.n], 1.0, self.n > 2

class NoStep:
    def reset(self, record):
        return None

not_a_class = 3
"""


@pytest.fixture
def env_file(tmp_path):
    path = tmp_path / "my_env.py"
    path.write_text(ENV_FILE)
    return str(path)


def test_a_class_loads_from_a_file_and_a_module(env_file):
    cls = load_environment(f"{env_file}:Counter")
    env = cls(start=5)
    assert env.step({"completion_ids": [1], "completion": None}) == ([6], 1.0, True)
    from rl_engine.envs.calculator import Calculator

    assert load_environment("rl_engine.envs.calculator:Calculator") is Calculator


@pytest.mark.parametrize(
    ("suffix", "message"),
    [
        ("Missing", "has no class 'Missing'"),
        ("not_a_class", "has no class 'not_a_class'"),
        ("NoStep", "NoStep has no step method"),
        ("", "expected path/to/file.py:Class or module:Class"),
    ],
)
def test_load_errors_name_the_key_and_what_is_wrong(env_file, suffix, message):
    spec = f"{env_file}:{suffix}" if suffix else env_file
    with pytest.raises(ValueError, match=message) as err:
        load_environment(spec)
    assert str(err.value).startswith("rollout.env ")


def test_missing_file_and_module_are_spec_errors(tmp_path):
    with pytest.raises(RewardSpecError, match=r"rollout.env .*does not exist"):
        load_environment(str(tmp_path / "nope.py") + ":Env")
    with pytest.raises(RewardSpecError, match=r"rollout.env .*cannot import module"):
        load_environment("no_such_module_xyz:Env")


def test_the_one_loader_still_loads_functions(env_file):
    """load_class is load_function's sibling: the same forms, the function loader unchanged."""
    with pytest.raises(RewardSpecError, match="has no function 'nothing'"):
        load_function(f"{env_file}:nothing", "reward.function", forms="x")
    assert load_function(f"{env_file}:Counter", "rollout.task", forms="x").__name__ == "Counter"


def test_a_call_that_raises_returns_its_error():
    def boom():
        raise KeyError("inside")

    call = call_env("step", boom, timeout_s=5)
    assert not call.ok and not call.timed_out and "step: KeyError: 'inside'" in call.error


def test_a_call_past_its_limit_is_interrupted():
    started = time.monotonic()
    call = call_env("step", time.sleep, 30, timeout_s=0.3)
    assert call.timed_out and "rollout.env_timeout_s = 0.3 s" in call.error
    assert time.monotonic() - started < 10


def test_a_call_that_swallows_exceptions_is_still_interrupted():
    def stubborn():
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                time.sleep(0.05)
            except Exception:  # the timeout is a BaseException: not caught here
                pass

    assert call_env("reset", stubborn, timeout_s=0.3).timed_out


@pytest.mark.parametrize(
    ("result", "message"),
    [
        ((None, 1.0), "must return \\(observation, reward, done\\)"),
        ("text", "must return \\(observation, reward, done\\)"),
        ((None, float("nan"), True), "reward must be a finite number"),
        ((None, "1", True), "reward must be a finite number"),
        ((None, True, True), "reward must be a finite number"),
        ((None, 1.0, "yes"), "done must be true or false"),
    ],
)
def test_step_results_of_the_wrong_form_are_errors(result, message):
    call = call_env("step", lambda: result, timeout_s=5, check=check_step)
    assert not call.ok and not call.timed_out
    with pytest.raises((TypeError, ValueError), match=message):
        check_step(result)


def test_a_good_step_result_is_normalised():
    import numpy as np

    assert check_step([[3, 4], np.float32(0.5), np.bool_(True)]) == ([3, 4], 0.5, True)
    assert check_step(("obs", 2, 0)) == ("obs", 2.0, False)
