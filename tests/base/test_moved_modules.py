"""The old import paths of moved modules: the same module object, with a DeprecationWarning that
names the new path; unknown names are not answered; the root holds no module file for them."""

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from rl_engine.base.moved_modules import MOVED

PACKAGE = Path(__file__).resolve().parents[2] / "rl_engine"


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_path_is_the_new_module_with_a_warning(old):
    """Run in a fresh interpreter: this process may already hold the old name."""
    new = MOVED[old]
    code = (
        "import importlib, warnings\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        f"    old = importlib.import_module({old!r})\n"
        f"new = importlib.import_module({new!r})\n"
        "assert old is new, (old, new)\n"
        "msgs = [str(w.message) for w in seen if w.category is DeprecationWarning]\n"
        f"assert any({new!r} in m for m in msgs), msgs\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


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
