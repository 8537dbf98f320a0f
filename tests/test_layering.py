"""The device decides the backend in one place: nothing outside rl_engine/kernels/ imports one.

Code elsewhere asks `rl_engine.kernels.get_op(name, device)` (and
`backend_layout` for layout facts); importing `rl_engine.kernels.native` or
`rl_engine.kernels.triton` directly would bypass the device dispatch.
"""

import ast
from pathlib import Path

import rl_engine

PACKAGE = Path(rl_engine.__file__).parent
BACKENDS = ("rl_engine.kernels.native", "rl_engine.kernels.triton", "rl_engine.kernels.cpp")


def _backend_references(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]  # importlib.import_module("rl_engine.kernels.native...")
        for name in names:
            if any(name == b or name.startswith(b + ".") for b in BACKENDS):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {name}")
    return found


def test_no_module_outside_kernels_imports_a_backend():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if (PACKAGE / "kernels") in path.parents:
            continue
        offenders += _backend_references(path)
    assert not offenders, "backend imported outside rl_engine/kernels/:\n" + "\n".join(offenders)


def test_the_check_sees_an_import(tmp_path):
    """Negative control: the walker does flag a direct backend import, or a module path string."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from rl_engine.kernels.native.attention import BLOCK_K\n"
        "import importlib\n"
        "importlib.import_module('rl_engine.kernels.triton')\n"
    )
    assert _backend_references(bad, tmp_path) == [
        "bad.py:1: rl_engine.kernels.native.attention",
        "bad.py:1: rl_engine.kernels.native.attention.BLOCK_K",
        "bad.py:3: rl_engine.kernels.triton",
    ]
