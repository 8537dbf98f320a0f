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


# ----------------------------------------------------------------------------- the worker stands alone

WORKER = PACKAGE / "executors" / "worker"
FORBIDDEN_IN_WORKER = ("ray", "rl_engine.executors.job")


def _imports(path: Path, forbidden: tuple[str, ...], root: Path = PACKAGE.parent) -> list[str]:
    """Every import (module level or inside a function) of a module in `forbidden`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
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
            if any(name == f or name.startswith(f + ".") for f in forbidden):
                found.append((node.lineno, f"{path.relative_to(root)}:{node.lineno}: {name}"))
    return [hit for _, hit in sorted(found)]


def test_the_worker_imports_neither_ray_nor_the_job():
    """executors/worker/ is the plugin a host framework drives: it must not need Ray or executors/job/."""
    files = sorted(WORKER.rglob("*.py"))
    assert files, f"no worker modules under {WORKER}"
    offenders = [hit for path in files for hit in _imports(path, FORBIDDEN_IN_WORKER)]
    assert not offenders, "the worker imports Ray or the job:\n" + "\n".join(offenders)


def test_the_worker_check_sees_an_import(tmp_path):
    """Negative control: a nested `import ray` and a job import are both flagged."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f():\n"
        "    import ray.util\n"
        "from rl_engine.executors.job import actors\n"
        "from rl_engine.executors.worker import batch\n"
    )
    assert _imports(bad, FORBIDDEN_IN_WORKER, tmp_path) == [
        "bad.py:2: ray.util",
        "bad.py:3: rl_engine.executors.job",
        "bad.py:3: rl_engine.executors.job.actors",
    ]


def test_public_executor_names_import():
    """The names DESIGN.md and users rely on stay where they were."""
    import rl_engine.executors as executors
    from rl_engine.executors.deepspeed_trainer import DeepSpeedTrainingWorker
    from rl_engine.executors.worker import deepspeed_trainer

    for name in ("DeepSpeedTrainingWorker", "TrainBatch", "BatchError", "ParityError"):
        assert getattr(executors, name).__name__ == name
    assert executors.build_deepspeed_config.__name__ == "build_deepspeed_config"
    assert DeepSpeedTrainingWorker is deepspeed_trainer.DeepSpeedTrainingWorker
    assert executors.DeepSpeedTrainingWorker is DeepSpeedTrainingWorker
