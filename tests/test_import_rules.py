"""The house's import rules, read from the syntax tree of every file (imports inside functions
and relative imports count too); each failure names the file, the line and the rule it broke.

- No import cycle in rl_engine/: no module imports one that imports it back, directly or
  not (TYPE_CHECKING and function-level imports included); the shared piece of two modules
  that need each other lives in a third that both import.
- rl_engine/kernels/ imports only the standard library, torch, numpy, triton and itself: the
  kernels stand below everything else.
- transformers and peft are imported only in rl_engine/patching/ and rl_engine/models/ (the
  one layer that knows Hugging Face; models/build.py builds models for export, preflight and
  the benchmarks).
- No module imports a private name (`from m import _x`) of another, in rl_engine/, tests/ and
  scripts/: a name used across modules is public.
- A test file imports no other test file: what test files share lives in a `conftest.py` or
  in `tests/helpers/`, and every module under tests/ that is not a test is there.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.helpers.imports import (
    PACKAGE,
    REPO,
    import_cycles,
    import_graph,
    imported_modules,
    resolved_imports,
)

NOT_HELPERS = ("conftest.py", "__init__.py")


# ----------------------------------------------------------------------------- no import cycles


def _cycle_report(package: Path, root: Path) -> list[str]:
    """One line per cycle: its modules, and the import of each that closes it."""
    graph = import_graph(package, root)
    reports = []
    for cycle in import_cycles(graph):
        edges = [
            f"{module} imports {target} (line {graph[module][target]})"
            for module in cycle
            for target in graph[module]
            if target in cycle
        ]
        reports.append(f"import cycle {' <-> '.join(cycle)}: " + "; ".join(edges))
    return reports


def test_rl_engine_has_no_import_cycle():
    assert _cycle_report(PACKAGE, REPO) == []


def test_the_cycle_check_sees_a_cycle_through_a_type_only_and_a_relative_import(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n"
    )
    (package / "b.py").write_text("def f():\n    from . import c\n")
    (package / "c.py").write_text("import pkg.a\n")
    (package / "d.py").write_text("from pkg import a\n")  # into the cycle, not in it
    assert _cycle_report(package, tmp_path) == [
        "import cycle pkg.a <-> pkg.b <-> pkg.c: pkg.a imports pkg.b (line 3); "
        "pkg.b imports pkg.c (line 2); pkg.c imports pkg.a (line 1)"
    ]


# ----------------------------------------------------------------------------- kernels stand alone

KERNEL_IMPORTS = ("torch", "numpy", "triton", "rl_engine.kernels")


def _kernel_import_allowed(module: str) -> bool:
    top = module.split(".")[0]
    return top in sys.stdlib_module_names or top == "__future__" or _within(module, KERNEL_IMPORTS)


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def _kernel_offenders(root: Path) -> list[str]:
    rule = "rl_engine/kernels/ imports only the standard library, torch, numpy, triton, itself"
    return [
        f"{path.relative_to(root)}:{line}: imports {module}: {rule}"
        for path in sorted((root / "rl_engine" / "kernels").rglob("*.py"))
        for line, module in imported_modules(path, root)
        if not _kernel_import_allowed(module)
    ]


def test_kernels_import_only_the_standard_library_torch_numpy_triton_and_themselves():
    assert _kernel_offenders(REPO) == []


def test_the_kernel_rule_sees_an_import_from_above(tmp_path):
    kernels = tmp_path / "rl_engine" / "kernels"
    kernels.mkdir(parents=True)
    (kernels / "fine.py").write_text("import os, torch, triton.language\nfrom . import other\n")
    (kernels / "bad.py").write_text("import numpy\ndef f():\n    from rl_engine.base.io import x\n")
    assert _kernel_offenders(tmp_path) == [
        "rl_engine/kernels/bad.py:3: imports rl_engine.base.io: rl_engine/kernels/ imports only "
        "the standard library, torch, numpy, triton, itself"
    ]


# ------------------------------------------------------------------ Hugging Face in one layer

HF_PACKAGES = ("transformers", "peft")
HF_LAYER = ("rl_engine/patching/", "rl_engine/models/")


def _hf_offenders(root: Path) -> list[str]:
    rule = "transformers and peft are imported only in rl_engine/patching/ and rl_engine/models/"
    return [
        f"{path.relative_to(root)}:{line}: imports {module}: {rule}"
        for path in sorted((root / "rl_engine").rglob("*.py"))
        if not path.relative_to(root).as_posix().startswith(HF_LAYER)
        for line, module in imported_modules(path, root)
        if _within(module, HF_PACKAGES)
    ]


def test_only_patching_and_models_import_transformers_or_peft():
    assert _hf_offenders(REPO) == []


def test_the_hf_rule_sees_an_import_outside_the_layer(tmp_path):
    for folder in ("models", "benchmarks"):
        (tmp_path / "rl_engine" / folder).mkdir(parents=True)
    (tmp_path / "rl_engine" / "models" / "ok.py").write_text(
        "from transformers import AutoConfig\n"
    )
    (tmp_path / "rl_engine" / "benchmarks" / "bad.py").write_text(
        "def f():\n    import peft.tuners\n"
    )
    assert _hf_offenders(tmp_path) == [
        "rl_engine/benchmarks/bad.py:2: imports peft.tuners: transformers and peft are imported "
        "only in rl_engine/patching/ and rl_engine/models/"
    ]


# ------------------------------------------------------------------------- private names stay home

PUBLIC_NAME_FOLDERS = ("rl_engine", "tests", "scripts")


def _private_name_offenders(root: Path) -> list[str]:
    rule = "a name imported from another module is public (no leading underscore)"
    return [
        f"{path.relative_to(root)}:{line}: imports {name} from {module}: {rule}"
        for folder in PUBLIC_NAME_FOLDERS
        for path in sorted((root / folder).rglob("*.py"))
        for line, module, names in resolved_imports(path, root)
        for name in names
        if name.startswith("_") and not name.startswith("__")
    ]


def test_no_module_imports_a_private_name_of_another():
    assert _private_name_offenders(REPO) == []


def test_the_private_name_rule_sees_a_private_import(tmp_path):
    for folder in PUBLIC_NAME_FOLDERS:
        (tmp_path / folder).mkdir()
    (tmp_path / "rl_engine" / "a.py").write_text("from rl_engine.b import public, _private\n")
    (tmp_path / "scripts" / "s.py").write_text("from __future__ import annotations\n")
    (tmp_path / "tests" / "test_t.py").write_text("def f():\n    from . import _helper\n")
    rule = "a name imported from another module is public (no leading underscore)"
    assert _private_name_offenders(tmp_path) == [
        f"rl_engine/a.py:1: imports _private from rl_engine.b: {rule}",
        f"tests/test_t.py:2: imports _helper from tests: {rule}",
    ]


# ----------------------------------------------------------------------------- test helpers


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
