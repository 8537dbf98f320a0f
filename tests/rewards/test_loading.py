"""Loading a user's plug-in (rl_engine/rewards/loading.py): `path/to/file.py[:name]` and
`module:name` for functions and classes, the built-ins and the data_source dispatch, verl's
signature checked on load, paths made absolute for worker processes, and a RewardSpecError
that names the key and the part that is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest

from rl_engine.rewards import RewardSpecError, load_reward_function
from rl_engine.rewards.loading import absolute_spec, by_data_source, load_class, load_function

REWARD_FILE = """
from helper_of_my_reward import ONE

class Env:
    pass

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return ONE if solution_str == ground_truth else 0.0

def two_args(solution_str, ground_truth):
    return 1.0

NOT_A_FUNCTION = 3
"""


@pytest.fixture
def verl_file(tmp_path):
    """A reward file that imports a module beside it, as verl's reward files may."""
    (tmp_path / "helper_of_my_reward.py").write_text("ONE = 1.0\n")
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD_FILE)
    return str(path)


def test_module_function_and_spec_errors(verl_file):
    fn = load_reward_function("rl_engine.rewards.gsm8k:compute_score")
    assert fn("openai/gsm8k", "#### 7", "7") == 1.0
    bad = [
        (f"{verl_file}:nope", "has no function 'nope'"),
        ("/no/such/reward.py:compute_score", "does not exist"),
        ("no_such_module_xyz:compute_score", "cannot import module 'no_such_module_xyz'"),
        (f"{verl_file}:two_args", r"cannot be called as compute_score\(data_source"),
    ]
    for spec, message in bad:
        with pytest.raises(RewardSpecError, match=message):
            load_reward_function(spec)
    with pytest.raises(RewardSpecError, match="unexpected keyword argument 'scale'"):
        load_reward_function(f"{verl_file}:compute_score", {"scale": 2})


def test_a_file_loads_once_with_its_own_folder_importable(verl_file):
    fn = load_reward_function(verl_file)  # the name defaults to compute_score
    assert fn("s", "12", "12") == 1.0 and fn("s", "12", "13") == 0.0
    assert load_function(f"{verl_file}:compute_score", "k", forms="f") is fn


def test_two_files_of_the_same_name_do_not_clash(tmp_path):
    for folder, value in (("a", 1.0), ("b", 2.0)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "reward.py").write_text(f"def f(**kw):\n    return {value}\n")
    a = load_function(str(tmp_path / "a" / "reward.py:f"), "k", forms="f")
    b = load_function(str(tmp_path / "b" / "reward.py:f"), "k", forms="f")
    assert (a(), b()) == (1.0, 2.0)


def test_a_class_is_loaded_by_name_and_a_function_is_not_a_class(verl_file):
    assert load_class(f"{verl_file}:Env", "rollout.env", forms="C").__name__ == "Env"
    cls = load_class("rl_engine.rewards.loading:RewardSpecError", "rollout.env", forms="C")
    assert cls is RewardSpecError
    with pytest.raises(
        RewardSpecError, match=r"^rollout\.env '.*:compute_score': .* has no class 'compute_score'"
    ):
        load_class(f"{verl_file}:compute_score", "rollout.env", forms="C")
    with pytest.raises(
        RewardSpecError, match=r"^rollout\.task '.*:NOT_A_FUNCTION': .* has no function"
    ):
        load_function(f"{verl_file}:NOT_A_FUNCTION", "rollout.task", forms="f")


@pytest.mark.parametrize("spec", [None, 3, "module_without_name", ":f", "mod:"])
def test_a_malformed_spec_says_what_the_key_takes(spec):
    with pytest.raises(RewardSpecError, match=r"^rollout\.task .*: expected module:function"):
        load_function(spec, "rollout.task", forms="module:function")


def test_a_file_that_raises_on_import_names_the_error(tmp_path):
    (tmp_path / "broken.py").write_text("raise KeyError('oops')\n")
    with pytest.raises(
        RewardSpecError, match=r"^reward\.function .*broken\.py raised KeyError: 'oops'"
    ):
        load_reward_function(str(tmp_path / "broken.py"))


def test_absolute_spec_resolves_file_paths_only(verl_file, monkeypatch):
    folder = Path(verl_file).parent
    monkeypatch.chdir(folder)
    assert absolute_spec("my_reward.py") == f"{folder.resolve()}/my_reward.py:compute_score"
    assert absolute_spec("my_reward.py:two_args") == f"{folder.resolve()}/my_reward.py:two_args"
    for spec in (None, "math", "gsm8k", "pkg.mod:fn"):
        assert absolute_spec(spec) == spec


def test_by_data_source_dispatches_as_verls_default():
    assert load_reward_function(None) is by_data_source
    assert by_data_source("openai/gsm8k", "#### 7", "7") == 1.0
    assert by_data_source("OpenAI/GSM8K-hard", "7", "7") == 0.0  # gsm8k: strict '####'
    assert by_data_source("lighteval/MATH", "\\boxed{7}", "7") == 1.0
