"""The packages' floors (docs/architecture.md, "Floors"): a package imports only packages on
floors below its own. The graph is built from the AST of every module (imports inside
functions count too), so a lazy import cannot hide an upward edge."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "rl_engine"

FLOORS = {
    0: {"kernels", "base"},
    1: {"patching", "exact", "rewards"},
    2: {"models", "algorithms", "data"},
    3: {"rollout", "logprobs"},
    4: {"config", "envs"},
    5: {"executors.worker", "diagnostics"},
    6: {"executors.job", "benchmarks", "executors"},
    7: {"cli", "rl_engine"},
}
FLOOR_OF = {name: floor for floor, names in FLOORS.items() for name in names}


def unit_of(module: str) -> str:
    """The floor-table name of a dotted module: its package under rl_engine (executors split in
    worker and job), `cli`, or `rl_engine` for the package's own __init__."""
    parts = module.split(".")[1:]
    if not parts:
        return "rl_engine"
    if parts[0] == "executors" and len(parts) > 1 and parts[1] in ("worker", "job"):
        return f"executors.{parts[1]}"
    return parts[0]


def imported_modules(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every rl_engine import in `path`, relative ones resolved."""
    rel = path.relative_to(root.parent).with_suffix("")
    package = list(rel.parts if path.name == "__init__.py" else rel.parts[:-1])
    if path.name == "__init__.py":
        package = package[:-1] if package[-1] == "__init__" else package
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package[: len(package) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            out += [(node.lineno, f"{base}.{a.name}") for a in node.names]
    return [(line, name) for line, name in out if name.split(".")[0] == root.name]


def upward_imports(root: Path) -> list[str]:
    """'file:line: unit (floor a) imports unit (floor b)' for every import not strictly downward."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        here = ".".join(path.relative_to(root.parent).with_suffix("").parts)
        here = here.removesuffix(".__init__")
        source = unit_of(here)
        for line, name in imported_modules(path, root):
            target = unit_of(name)
            if target == source:
                continue
            if target not in FLOOR_OF or source not in FLOOR_OF:
                bad.append(f"{path}:{line}: {source} or {target} is on no floor")
            elif FLOOR_OF[target] >= FLOOR_OF[source]:
                bad.append(
                    f"{path}:{line}: {source} (floor {FLOOR_OF[source]}) imports "
                    f"{target} (floor {FLOOR_OF[target]})"
                )
    return bad


def test_every_package_is_on_a_floor():
    packages = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    packages = (packages - {"executors"}) | {"executors", "executors.worker", "executors.job"}
    assert packages | {"cli", "rl_engine"} == set(FLOOR_OF)


def test_packages_import_only_downward():
    bad = upward_imports(PACKAGE)
    assert not bad, "imports that do not go down a floor:\n" + "\n".join(bad)


def test_the_floor_check_sees_an_upward_and_a_sideways_import(tmp_path):
    """Negative control: a kernel importing base (sideways, floor 0), a lazy import of the
    job from the worker (upward) and a relative import are flagged; a downward one is not."""
    root = tmp_path / "rl_engine"
    for sub in ("kernels", "base", "executors/worker", "executors/job", "patching"):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
    (root / "kernels" / "op.py").write_text("from rl_engine.base import io\n")
    (root / "executors" / "worker" / "step.py").write_text(
        "def f():\n    from rl_engine.executors.job import ray_job\n"
    )
    (root / "patching" / "apply.py").write_text(
        "from ..kernels import op\nfrom .. import executors\n"
    )
    bad = upward_imports(root)
    assert [b.split(": ", 1)[1] for b in bad] == [
        "executors.worker (floor 5) imports executors.job (floor 6)",
        "kernels (floor 0) imports base (floor 0)",
        "patching (floor 1) imports executors (floor 6)",
    ]
