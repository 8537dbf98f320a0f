"""The house's import rules, read from the syntax tree of every file (imports inside functions
and relative imports count too); each failure names the file, the line and the rule it broke.

- A test file imports no other test file: what test files share lives in a `conftest.py` or
  in `tests/helpers/`, and every module under tests/ that is not a test is there.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.imports import REPO, imported_modules

NOT_HELPERS = ("conftest.py", "__init__.py")


def _imports_outside_helpers(root: Path) -> list[str]:
    """Every import, in a file under tests/, of a module of tests/ outside tests/helpers/."""
    found = []
    for path in sorted((root / "tests").rglob("*.py")):
        for line, module in imported_modules(path, root):
            if module.startswith("tests.") and not module.startswith("tests.helpers"):
                rule = "a test file imports only helpers (tests/helpers/, conftest.py)"
                found.append(f"{path.relative_to(root)}:{line}: imports {module}: {rule}")
    return found


def _helpers_outside_helpers(root: Path) -> list[str]:
    """Every module under tests/ that is neither a test nor in tests/helpers/."""
    tests = root / "tests"
    return [
        f"{path.relative_to(root)}: not a test: a helper module belongs in tests/helpers/"
        for path in sorted(tests.rglob("*.py"))
        if not path.name.startswith("test_")
        and path.name not in NOT_HELPERS
        and not path.is_relative_to(tests / "helpers")
    ]


def test_test_files_import_only_helpers():
    assert _imports_outside_helpers(REPO) == []
    assert _helpers_outside_helpers(REPO) == []


def test_the_helper_rule_sees_a_test_file_import_and_a_stray_helper(tmp_path):
    (tmp_path / "tests" / "helpers").mkdir(parents=True)
    (tmp_path / "tests" / "rollout").mkdir()
    (tmp_path / "tests" / "rollout" / "test_a.py").write_text("X = 1\n")
    (tmp_path / "tests" / "rollout" / "shared.py").write_text("Y = 1\n")
    (tmp_path / "tests" / "helpers" / "fine.py").write_text("Z = 1\n")
    (tmp_path / "tests" / "rollout" / "test_b.py").write_text(
        "from tests.helpers.fine import Z\n"
        "from . import test_a\n"
        "def f():\n"
        "    from .shared import Y\n"
    )
    assert _imports_outside_helpers(tmp_path) == [
        "tests/rollout/test_b.py:2: imports tests.rollout.test_a: "
        "a test file imports only helpers (tests/helpers/, conftest.py)",
        "tests/rollout/test_b.py:4: imports tests.rollout.shared: "
        "a test file imports only helpers (tests/helpers/, conftest.py)",
    ]
    assert _helpers_outside_helpers(tmp_path) == [
        "tests/rollout/shared.py: not a test: a helper module belongs in tests/helpers/"
    ]
