"""What a Python file imports, read from its syntax tree (the layering and import-rule tests)."""

from __future__ import annotations

import ast
from pathlib import Path

import rl_engine

PACKAGE = Path(rl_engine.__file__).parent
REPO = PACKAGE.parent


def imported_names(path: Path):
    """(line, dotted name) of every import in `path`, module level or inside a function, and of
    every string that names an rl_engine module (importlib.import_module("rl_engine...."))."""
    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if node.value.startswith("rl_engine.") else []
        else:
            continue
        for name in names:
            yield node.lineno, name


def forbidden_imports(path: Path, forbidden: tuple[str, ...], root: Path = REPO) -> list[str]:
    """Every import (module level or inside a function) of a module in `forbidden`."""
    found = [
        (line, f"{path.relative_to(root)}:{line}: {name}")
        for line, name in imported_names(path)
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]
    return [hit for _, hit in sorted(found)]


def module_name(path: Path, root: Path = REPO) -> str:
    """The dotted name `path` is imported by (a package by its folder's name)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def resolved_imports(path: Path, root: Path = REPO):
    """(line, module, names) of every import in `path`, anywhere in the file, relative ones
    resolved: `from . import x` gives the package and ["x"], `import a.b` gives "a.b" and []."""
    own = module_name(path, root)
    package = own if path.name == "__init__.py" else own.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield node.lineno, alias.name, []
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            yield node.lineno, module, [alias.name for alias in node.names]


def imported_modules(path: Path, root: Path = REPO):
    """(line, dotted module) for every module `path` imports; `from pkg import name` counts as
    pkg.name when that is a module under `root`, else as pkg."""
    for line, module, names in resolved_imports(path, root):
        targets = [f"{module}.{name}" for name in names if _is_module(f"{module}.{name}", root)]
        for target in targets or [module]:
            yield line, target


def _is_module(dotted: str, root: Path) -> bool:
    base = root.joinpath(*dotted.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def import_graph(package: Path, root: Path = REPO) -> dict[str, dict[str, int]]:
    """module -> {module of the same package it imports: the line}; an import of a name from a
    package is an edge to the package (its __init__), of a missing module to its nearest parent."""
    modules = {module_name(path, root): path for path in sorted(package.rglob("*.py"))}
    graph: dict[str, dict[str, int]] = {}
    for name, path in modules.items():
        edges = graph.setdefault(name, {})
        for line, target in imported_modules(path, root):
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                edges.setdefault(target, line)
    return graph


def import_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in graph.get(node, {}):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return sorted(cycles)
