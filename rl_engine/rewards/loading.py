"""Loading a user's plug-in: `reward.function`, `rollout.task`'s `module:function`, `rollout.env`.

One loader (`load_function`, and `load_class` for `rollout.env`'s class) serves every key, in
the same forms:
- `path/to/file.py:name` (for `reward.function` also `path/to/file.py`, name
  `compute_score`): a file, loaded from its path as it is (its own folder is put on
  sys.path for its imports);
- `package.module:name`: an importable function.

`reward.function` (`load_reward_function`) also takes the built-ins `math` and `gsm8k`
(rl_engine.rewards.math_answer, .gsm8k), and null: by each sample's data_source, as verl's
default_compute_score does (`gsm8k` in the name: gsm8k; anything else: math). It is called
as fn(data_source=, solution_str=, ground_truth=, extra_info=, **reward.kwargs) and returns
a float (bool, int) or a dict with a numeric 'score'; that signature is checked on load.
A `rollout.task` function is called as fn(samples) -> list[float] (rl_engine.data.tasks).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import inspect
import sys
from collections.abc import Callable
from pathlib import Path

BUILTINS = ("math", "gsm8k")
DEFAULT_NAME = "compute_score"


class RewardSpecError(ValueError):
    """reward.function (or rollout.task's module:function) names nothing callable with the
    signature its key needs (exit code 2)."""


def by_data_source(data_source: str, solution_str: str, ground_truth, extra_info=None, **kwargs):
    """verl's default dispatch: gsm8k sources -> gsm8k, everything else -> math."""
    from rl_engine.rewards import gsm8k, math_answer

    module = gsm8k if "gsm8k" in str(data_source).lower() else math_answer
    return module.compute_score(data_source, solution_str, ground_truth, extra_info, **kwargs)


def load_reward_function(spec: str | None, kwargs: dict | None = None) -> Callable:
    """The callable `reward.function` names; RewardSpecError says which part is wrong."""
    if spec is None:
        return by_data_source
    if spec in BUILTINS:
        module = importlib.import_module(
            f"rl_engine.rewards.{'gsm8k' if spec == 'gsm8k' else 'math_answer'}"
        )
        fn = module.compute_score
    else:
        fn = load_function(
            spec,
            "reward.function",
            forms="math, gsm8k, path/to/file.py:function or module:function",
            default_name=DEFAULT_NAME,
        )
    _check_signature(fn, spec, kwargs or {})
    return fn


def load_function(spec: str, key: str, *, forms: str, default_name: str | None = None) -> Callable:
    """The function `spec` (the value of config key `key`) names: `module:name` or
    `path/to/file.py:name` (without `:name`: `default_name`, when there is one).
    RewardSpecError names the key and says which part is wrong (`forms`: what the key takes)."""
    target, name, found = _load_attribute(spec, key, forms, default_name)
    if not callable(found):
        raise RewardSpecError(f"{key} {spec!r}: {target} has no function {name!r}")
    return found


def load_class(spec: str, key: str, *, forms: str) -> type:
    """The class `spec` (the value of config key `key`) names, in the forms of `load_function`
    (`module:Class` or `path/to/file.py:Class`; the name is required)."""
    target, name, found = _load_attribute(spec, key, forms, None)
    if not isinstance(found, type):
        raise RewardSpecError(f"{key} {spec!r}: {target} has no class {name!r}")
    return found


def _load_attribute(spec: str, key: str, forms: str, default_name: str | None):
    """(module part, name, the module's attribute `name` or None) of `module:name` /
    `path.py:name`; RewardSpecError when the spec is malformed or the module does not load."""
    if not isinstance(spec, str):
        raise RewardSpecError(f"{key} {spec!r}: expected {forms}")
    target, _, name = spec.rpartition(":") if ":" in spec else (spec, "", default_name)
    if not target or not name:
        raise RewardSpecError(f"{key} {spec!r}: expected {forms}")
    if _is_file_spec(target):
        module = _load_file(target, spec, key)
    else:
        module = _import(target, spec, key)
    return target, name, getattr(module, name, None)


def absolute_spec(spec: str | None) -> str | None:
    """`spec` with a file path made absolute (worker processes may start in another folder)."""
    if spec is None or spec in BUILTINS:
        return spec
    target, _, name = spec.rpartition(":") if ":" in spec else (spec, "", DEFAULT_NAME)
    if not _is_file_spec(target):
        return spec
    return f"{Path(target).expanduser().resolve()}:{name or DEFAULT_NAME}"


def _is_file_spec(target: str) -> bool:
    return target.endswith(".py") or "/" in target or "\\" in target


def _load_file(target: str, spec: str, key: str):
    path = Path(target).expanduser().resolve()
    if not path.is_file():
        raise RewardSpecError(f"{key} {spec!r}: file {str(path)!r} does not exist")
    # One module per file path, named after it: two reward files called reward.py never clash.
    name = f"rl_engine_reward_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    folder = str(path.parent)
    if folder not in sys.path:
        sys.path.append(folder)  # the file's own helper modules import as they do under verl
    loader_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(loader_spec)
    sys.modules[name] = module
    try:
        loader_spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[name]
        raise RewardSpecError(
            f"{key} {spec!r}: importing {path} raised {type(err).__name__}: {err}"
        ) from None
    return module


def _import(target: str, spec: str, key: str):
    try:
        return importlib.import_module(target)
    except ImportError as err:
        raise RewardSpecError(
            f"{key} {spec!r}: cannot import module {target!r} ({err}); is it on "
            "PYTHONPATH, or did you mean a file path ending in .py?"
        ) from None


def _check_signature(fn: Callable, spec: str, kwargs: dict) -> None:
    """verl calls compute_score with keywords: they (and reward.kwargs) must bind."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # a builtin or C function: nothing to check ahead
    try:
        signature.bind(data_source="", solution_str="", ground_truth="", extra_info=None, **kwargs)
    except TypeError as err:
        raise RewardSpecError(
            f"reward.function {spec!r}: {getattr(fn, '__name__', fn)}{signature} cannot be called "
            f"as compute_score(data_source, solution_str, ground_truth, extra_info"
            f"{', **reward.kwargs' if kwargs else ''}) ({err})"
        ) from None
