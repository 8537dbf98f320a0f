"""The old import paths of moved modules: the same module object, with a DeprecationWarning that
names the new path; unknown names are not answered; the root holds no module file for them."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from rl_engine.base.moved_modules import MOVED

PACKAGE = Path(__file__).resolve().parents[2] / "rl_engine"


OLD_PATHS_CHECK = """
import importlib, json, sys, warnings
failures = []
for old, new in sorted(json.loads(sys.argv[1]).items()):
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = importlib.import_module(old)
    if module is not importlib.import_module(new):
        failures.append(f"{old} is {module!r}, not {new}")
    notes = [str(w.message) for w in seen if w.category is DeprecationWarning]
    if not any(new in note for note in notes):
        failures.append(f"{old}: no DeprecationWarning naming {new} (saw {notes})")
print(json.dumps(failures))
"""


def test_every_old_path_is_the_new_module_with_a_warning():
    """In one fresh interpreter (this process may already hold an old name), each old path in
    turn: importing a new module never answers an old name, so each import goes through the
    finder and must warn."""
    out = subprocess.run(
        [sys.executable, "-c", OLD_PATHS_CHECK, json.dumps(MOVED)],
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    ).stdout
    assert json.loads(out.strip().splitlines()[-1]) == []


def test_from_import_of_an_old_name_is_the_new_class():
    with pytest.warns(DeprecationWarning, match="rl_engine.exact.records"):
        sys.modules.pop("rl_engine.sums", None)
        old = importlib.import_module("rl_engine.sums")
    from rl_engine.exact.records import Sums

    assert old.Sums is Sums


def test_a_name_that_never_existed_is_still_an_import_error():
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("rl_engine.no_such_module")


def test_no_old_module_file_stands_at_the_root():
    """The root keeps __init__.py and cli.py; the old names live only in the finder."""
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "cli.py"]
    for old, new in MOVED.items():
        assert (PACKAGE.parent / (new.replace(".", "/") + ".py")).is_file(), new
        assert not (PACKAGE.parent / (old.replace(".", "/") + ".py")).exists(), old
