"""Tests mirror the package: the tests of `rl_engine/<path>/<module>.py` are in
`tests/<path>/test_<module>.py` (docs/testing.md, "Where a test lives"), and every such file
tests its module (imports it).

At least MIN_FRACTION of the modules with logic have their mirror file (214 of 239, 89%, on
2026-12-04; docs/testing.md lists what is left): a module added without its tests eats into
the margin, and the test prints the list."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "rl_engine"
MIN_FRACTION = 0.8


def has_logic(path: Path) -> bool:
    """A module defines a function or a class (a package's re-exports, constants and data do not count)."""
    tree = ast.parse(path.read_text(), str(path))
    return any(
        isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) for n in tree.body
    )


def mirror_of(path: Path, package: Path = PACKAGE, tests: Path = ROOT / "tests") -> Path:
    """tests/<path>/test_<module>.py; a package's __init__.py is tested in test_<package>.py
    beside the package's own folder of tests, a private module _x.py in test_x.py."""
    rel = path.relative_to(package)
    if path.name == "__init__.py":
        return tests / rel.parent / f"test_{rel.parent.name or package.name}.py"
    return tests / rel.parent / f"test_{rel.stem.lstrip('_')}.py"


def modules_with_logic(package: Path = PACKAGE) -> list[Path]:
    return [p for p in sorted(package.rglob("*.py")) if "_build" not in p.parts and has_logic(p)]


def dotted(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def defined_names(path: Path) -> set[str]:
    """The names a module defines at its top level (functions, classes, assignments)."""
    names = set()
    for node in ast.parse(path.read_text(), str(path)).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def imports_module(test_file: Path, module: str, names: set[str] = frozenset()) -> bool:
    """Whether the test file imports `module`, or one of its `names` through a package above it
    (`from rl_engine.algorithms import compute_advantages` tests algorithms/advantages.py)."""
    for node in ast.walk(ast.parse(test_file.read_text(), str(test_file))):
        if isinstance(node, ast.Import) and any(
            a.name == module or a.name.startswith(module + ".") for a in node.names
        ):
            return True
        if isinstance(node, ast.ImportFrom) and node.module:
            if node.module == module or node.module.startswith(module + "."):
                return True
            if module.startswith(node.module + "."):
                leaf = module[len(node.module) + 1 :].split(".")[0]
                if any(a.name == leaf or a.name in names for a in node.names):
                    return True
    return False


def test_most_modules_have_their_mirror_test():
    modules = modules_with_logic()
    missing = [str(p.relative_to(ROOT)) for p in modules if not mirror_of(p).is_file()]
    fraction = 1 - len(missing) / len(modules)
    assert fraction >= MIN_FRACTION, (
        f"{fraction:.0%} of {len(modules)} modules with logic have tests/<path>/test_<module>.py "
        f"(at least {MIN_FRACTION:.0%} must); without one:\n" + "\n".join(missing)
    )


def test_every_mirror_test_imports_its_module():
    bad = [
        f"{mirror_of(p).relative_to(ROOT)} does not import {dotted(p)}"
        for p in modules_with_logic()
        if mirror_of(p).is_file() and not imports_module(mirror_of(p), dotted(p), defined_names(p))
    ]
    assert not bad, "\n".join(bad)


def test_the_mirror_check_sees_a_missing_and_a_foreign_test(tmp_path):
    """Negative control on a two-module package: one mirror missing, one that tests another module."""
    package, tests = tmp_path / "pkg", tmp_path / "tests"
    (package / "sub").mkdir(parents=True)
    (tests / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("X = 1\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "a.py").write_text("def f():\n    return 1\n")
    (package / "sub" / "b.py").write_text("class B:\n    pass\n")
    (tests / "sub" / "test_b.py").write_text("from pkg.sub.a import f\n")
    modules = modules_with_logic(package)
    assert [p.name for p in modules] == ["a.py", "b.py"]
    mirrors = [mirror_of(p, package, tests) for p in modules]
    assert [m.is_file() for m in mirrors] == [False, True]
    assert not imports_module(mirrors[1], dotted(modules[1], package), {"B"})
    assert imports_module(mirrors[1], dotted(modules[0], package), {"f"})
    (tests / "sub" / "test_b.py").write_text("from pkg.sub import B\n")
    assert imports_module(mirrors[1], dotted(modules[1], package), {"B"})
