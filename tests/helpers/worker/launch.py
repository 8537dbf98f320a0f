"""Run a spec on N real DeepSpeed ranks (`ds_runner.py`) and collect their result files: on this
pytest process's long-lived world of N ranks (world_server.py), or in a launch of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from rl_engine.executors.worker.distributed import free_port
from tests.helpers.worker import world_server

RUNNER = world_server.RUNNER


def rank_env(rank: int, world: int, port: int) -> dict:
    return {
        **os.environ,
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }


def run_ranks(
    spec: dict, world: int, out_dir: Path, timeout: float = 300, *, fresh: bool = False
) -> tuple[list[dict], str | None]:
    """Run `world` ranks on `spec`; return (each rank's {cell: result}, the first error text or None).

    The ranks are this process's world server of `world` ranks (each run from a fresh rank's
    state: the bits of a launch of its own, see test_world_server.py), or with `fresh` a
    launch of their own (a test whose subject is a launch). As soon as one rank fails the
    others are killed (they may wait in a collective forever).
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    spec_path = out_dir / "spec.json"
    spec_path.write_text(json.dumps({**spec, "world": world, "out_dir": str(out_dir)}))
    if fresh:
        error = _launch(spec_path, world, out_dir, timeout)
    else:
        error = world_server.serve(spec_path, world, out_dir, timeout, rank_env)
    return [_load(out_dir / f"rank{rank}.pt") for rank in range(world)], error


def _launch(spec_path: Path, world: int, out_dir: Path, timeout: float) -> str | None:
    """The ranks' first error text or None, from a launch of their own."""
    port = free_port()
    logs = [open(out_dir / f"rank{rank}.log", "w") for rank in range(world)]  # noqa: SIM115 - closed below
    procs = [
        subprocess.Popen(
            [sys.executable, str(RUNNER), str(spec_path)],
            env=rank_env(rank, world, port),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        for rank, log in enumerate(logs)
    ]
    try:
        error = _wait(procs, out_dir, timeout)
    finally:
        for proc, log in zip(procs, logs):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    return error


def _wait(procs, out_dir: Path, timeout: float) -> str | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        codes = [proc.poll() for proc in procs]
        failed = [rank for rank, code in enumerate(codes) if code not in (None, 0)]
        if failed:
            return world_server.error_text(out_dir, failed[0], codes[failed[0]])
        if all(code == 0 for code in codes):
            return None
        time.sleep(0.2)
    return f"ranks did not finish within {timeout:.0f} s; see {out_dir}/rank*.log"


def _load(path: Path) -> dict:
    return torch.load(path, weights_only=False) if path.is_file() else {}


def run_worlds(
    job: str, runs: dict[str, tuple[int, dict]], out_dir: Path, timeout: float = 300
) -> dict[str, dict]:
    """Rank 0's result of each named run of `job` ({name: (world size, spec)}): the runs of one
    world size run in turn in one request to its world (ds_runner.py's `runs`, each from a
    fresh rank's state); `timeout` is per run."""
    by_world: dict[int, dict[str, dict]] = {}
    for name, (world, spec) in runs.items():
        by_world.setdefault(world, {})[name] = spec
    results = {}
    for world, named in sorted(by_world.items()):
        spec = {"job": job, "runs": [{"name": name, **spec} for name, spec in named.items()]}
        ranks, error = run_ranks(spec, world, out_dir / f"world{world}", timeout * len(named))
        assert error is None, error
        results.update(zip(named, ranks[0][job.rsplit(".", 1)[-1]], strict=True))
    return results


def selected_runs(request, runs_by_test: dict[str, dict]) -> dict:
    """The runs that this module's selected tests need (`runs_by_test`: a test's name, or its
    name with parameters, -> its {run name: run}), so a module fixture launches only those."""
    selected = set()
    for item in request.session.items:
        if item.module is request.module:
            selected |= {item.name, getattr(item, "originalname", item.name)}
    unknown = [test for test in runs_by_test if test.split("[")[0] not in _test_names(request)]
    assert not unknown, f"runs planned for tests this module does not hold: {unknown}"
    wanted = {}
    for test, runs in runs_by_test.items():
        if test in selected:
            clash = [name for name in runs if wanted.get(name, runs[name]) != runs[name]]
            assert not clash, f"runs {clash} are planned twice with different specs"
            wanted.update(runs)
    return wanted


def _test_names(request) -> set[str]:
    return {name for name in dir(request.module) if name.startswith("test_")}
