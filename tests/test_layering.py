"""The device decides the backend in one place: nothing outside rl_engine/kernels/ imports one.

Code elsewhere asks `rl_engine.kernels.get_op(name, device)` (and
`backend_layout` for layout facts); importing `rl_engine.kernels.native` or
`rl_engine.kernels.triton` directly would bypass the device dispatch.
"""

import ast
from pathlib import Path

import pytest

import rl_engine
from tests.helpers.imports import forbidden_imports, imported_names

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


def test_the_worker_imports_neither_ray_nor_the_job():
    """executors/worker/ is the plugin a host framework drives: it must not need Ray or executors/job/."""
    files = sorted(WORKER.rglob("*.py"))
    assert files, f"no worker modules under {WORKER}"
    offenders = [hit for path in files for hit in forbidden_imports(path, FORBIDDEN_IN_WORKER)]
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
    assert forbidden_imports(bad, FORBIDDEN_IN_WORKER, tmp_path) == [
        "bad.py:2: ray.util",
        "bad.py:3: rl_engine.executors.job",
        "bad.py:3: rl_engine.executors.job.actors",
    ]


def test_public_executor_names_import():
    """The names DESIGN.md and users rely on stay where they were."""
    import rl_engine.executors as executors
    from rl_engine.executors.deepspeed_trainer import DeepSpeedTrainingWorker
    from rl_engine.executors.worker.policy import worker as deepspeed_trainer

    for name in ("DeepSpeedTrainingWorker", "TrainBatch", "BatchError", "ParityError"):
        assert getattr(executors, name).__name__ == name
    assert executors.build_deepspeed_config.__name__ == "build_deepspeed_config"
    assert DeepSpeedTrainingWorker is deepspeed_trainer.DeepSpeedTrainingWorker
    assert executors.DeepSpeedTrainingWorker is DeepSpeedTrainingWorker


# ----------------------------------------------------------------------------- the rollout layer

ROLLOUT = PACKAGE / "rollout"
ABOVE_ROLLOUT = (
    "rl_engine.executors",
    "rl_engine.diagnostics",
    "rl_engine.cli",
    "ray",
    "deepspeed",
)


def test_the_rollout_layer_imports_nothing_above_it():
    """rollout/ (the engine, and the receiving side of a weight sync) sits below executors/:
    the weight group is handed to it, never imported by it."""
    files = sorted(ROLLOUT.rglob("*.py"))
    assert any(f.name == "weight_receiver.py" for f in files)
    offenders = [hit for path in files for hit in forbidden_imports(path, ABOVE_ROLLOUT)]
    assert not offenders, "rollout/ imports a layer above it:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------- data and rewards stand alone

FORBIDDEN_IN_DATA = ("ray", "torch", "deepspeed", "rl_engine.executors", "rl_engine.kernels")


@pytest.mark.parametrize("package", ["data", "rewards"])
def test_data_and_rewards_import_no_job_ray_or_torch(package):
    """rl_engine/data and rl_engine/rewards are plain Python (a verl reward runs anywhere): the
    Ray reward workers and the job's wiring live in executors/job/."""
    files = sorted((PACKAGE / package).rglob("*.py"))
    assert files, f"no modules under {PACKAGE / package}"
    offenders = [hit for path in files for hit in forbidden_imports(path, FORBIDDEN_IN_DATA)]
    assert not offenders, f"rl_engine/{package} imports:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------- environments stand alone

ENVS = PACKAGE / "envs"
ABOVE_ENVS = ("ray", "deepspeed", "rl_engine.executors", "rl_engine.diagnostics", "rl_engine.cli")


def test_environments_import_neither_the_job_nor_ray():
    """rl_engine/envs (the protocol, the episode loop, the shipped environments) runs over any
    engine: the job drives it with its engines (executors/job/episodes.py), never the reverse."""
    files = sorted(ENVS.rglob("*.py"))
    assert any(f.name == "episode.py" for f in files)
    offenders = [hit for path in files for hit in forbidden_imports(path, ABOVE_ENVS)]
    assert not offenders, "rl_engine/envs imports a layer above it:\n" + "\n".join(offenders)


# ----------------------------------------------------------------------------- scripts are entry points

SCRIPTS = PACKAGE.parent / "scripts"


def _private_imports(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    """Every rl_engine module or name `path` imports whose dotted path has a part starting with
    '_' (module level or inside a function, or a module-path string)."""
    found = []
    for line, name in imported_names(path):
        parts = name.split(".")
        if parts[0] == "rl_engine" and any(part.startswith("_") for part in parts):
            found.append((line, f"{path.relative_to(root)}:{line}: {name}"))
    return [hit for _, hit in sorted(found)]


def test_scripts_import_only_public_names():
    """scripts/ holds entry points: what they need of the package is public (a script that
    reaches for a private name is package logic living in the wrong place)."""
    files = sorted(SCRIPTS.glob("*.py"))
    assert any(f.name == "compile_gpu_kernels.py" for f in files)
    offenders = [hit for path in files for hit in _private_imports(path)]
    assert not offenders, "scripts import private names:\n" + "\n".join(offenders)


def test_the_public_names_check_sees_a_private_import(tmp_path):
    """Negative control: a private module, a private name, a nested import and a module-path
    string are flagged; public imports (and private names outside rl_engine) are not."""
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import os._private\n"
        "from rl_engine.kernels.triton.aot import main\n"
        "from rl_engine.kernels.cpp._extension import extension\n"
        "from rl_engine.benchmarks.kernels import _linear\n"
        "def f():\n"
        "    import rl_engine._version\n"
        "    return __import__('importlib').import_module('rl_engine.kernels._x')\n"
    )
    assert _private_imports(bad, tmp_path) == [
        "bad.py:3: rl_engine.kernels.cpp._extension",
        "bad.py:3: rl_engine.kernels.cpp._extension.extension",
        "bad.py:4: rl_engine.benchmarks.kernels._linear",
        "bad.py:6: rl_engine._version",
        "bad.py:7: rl_engine.kernels._x",
    ]


# ----------------------------------------------------------------------------- benchmarks reachable from the CLI

BENCHMARKS = PACKAGE / "benchmarks"


def _bench_references(path: Path) -> set[str]:
    """The rl_engine.benchmarks modules `path` imports or names as a module-path string
    (`python -m rl_engine.benchmarks.X`, the fresh-process probes)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        else:
            continue
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["rl_engine", "benchmarks"] and len(parts) > 2:
                found.add(parts[2])
    return found


def _unreachable_benchmarks(folder: Path, named: set[str]) -> list[str]:
    """Modules of `folder` (but __init__) that neither `rl-engine bench` names (`named`) nor a
    named module reaches through imports and module-path strings: code no command runs."""
    modules = {path.stem for path in folder.glob("*.py")} - {"__init__"}
    reached, todo = set(), sorted(named & modules)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += sorted(_bench_references(folder / f"{module}.py") & modules)
    return sorted(modules - reached)


def _cli_benchmarks() -> dict[tuple[str, str | None, str, str], tuple[str, ...]]:
    from rl_engine import cli

    tables = (
        ("cpu", "own", cli.BENCH_CASES),
        ("cuda", "own", cli.BENCH_CASES_CUDA),
        ("cpu", "vllm", cli.BENCH_CASES_VLLM),
    )
    return {
        (what, case, device, engine): modules
        for device, engine, table in tables
        for what, cases in table.items()
        for case, modules in cases.items()
    }


def test_every_benchmark_is_reachable_from_rl_engine_bench():
    """Each module of rl_engine/benchmarks is run by some `rl-engine bench WHAT [--case C]`
    (cli.BENCH_CASES), or is a helper such a module imports: no benchmark lives only behind
    a script."""
    benchmarks = _cli_benchmarks()
    named = {module for modules in benchmarks.values() for module in modules}
    missing = sorted(m for m in named if not (BENCHMARKS / f"{m}.py").is_file())
    assert not missing, f"cli.BENCH_CASES names modules that do not exist: {missing}"
    for module in named:  # what cmd_bench calls: main(argv)
        tree = ast.parse((BENCHMARKS / f"{module}.py").read_text())
        assert any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body), module
    unreachable = _unreachable_benchmarks(BENCHMARKS, named)
    assert not unreachable, f"benchmark modules no `rl-engine bench` reaches: {unreachable}"


def test_every_bench_case_parses():
    """The table and the command line agree: each (WHAT, --case, --device, --engine) of the
    table is accepted, and a case of another WHAT, or vLLM beside another WHAT, is refused."""
    from rl_engine import cli

    parser = cli.build_parser()
    for what, case, device, engine in _cli_benchmarks():
        argv = ["bench", what, "--device", device, "--engine", engine]
        args = parser.parse_args(argv + (["--case", case] if case else []))
        cli._check_bench_args(parser, args)
        assert (args.what, args.case, args.device, args.engine) == (what, case, device, engine)
    for argv in (
        ["bench", "moe", "--case", "tp"],
        ["bench", "train", "--engine", "vllm"],
        ["bench", "rollout", "--engine", "vllm", "--case", "prefill"],
        ["bench", "rollout", "--engine", "vllm", "--device", "cuda"],
    ):
        with pytest.raises(SystemExit):
            cli._check_bench_args(parser, parser.parse_args(argv))


def test_the_reachability_check_sees_an_orphan(tmp_path):
    """Negative control: a helper imported by a named module and a probe it names by module
    path are reached; a module nothing names is not."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "named.py").write_text("from rl_engine.benchmarks.helper import f\n")
    (tmp_path / "helper.py").write_text(
        "def f():\n    return ['python', '-m', 'rl_engine.benchmarks.probe']\n"
    )
    (tmp_path / "probe.py").write_text("")
    (tmp_path / "orphan.py").write_text("import rl_engine.benchmarks.timing\n")
    assert _unreachable_benchmarks(tmp_path, {"named"}) == ["orphan"]
    assert _unreachable_benchmarks(tmp_path, set()) == ["helper", "named", "orphan", "probe"]
