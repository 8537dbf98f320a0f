"""Entry point of one DeepSpeed rank in the multi-process tests: `python ds_runner.py SPEC.json`.

The parent sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and
DS_ACCELERATOR=cpu. SPEC lists the cells to run in this one job (so the ranks
start and rendezvous once), the completions file of each dtype and the output
folder. After every cell the rank rewrites `rank{RANK}.pt` (torch.save of
{cell name: result}); on an error it writes `rank{RANK}.error` with the cell
and the traceback and exits 1 (the other ranks may be stuck in a collective:
the parent kills them). A `job` spec with `runs` (a list of dicts, each laid over the rest of
the spec) runs them one after the other in this one world, each from a fresh process's seed,
and saves the list of their results.

`python ds_runner.py --serve` (tests/helpers/worker/world_server.py) is a long-lived rank: it
starts and rendezvouses once, then reads one SPEC path a line from stdin (a blocking read),
runs it as above from a fresh rank's state with its prints in the spec's out_dir
`rank{RANK}.log`, and writes `done` on its original stdout; on an error it exits as above, on
stdin EOF it exits 0.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

SERVE = sys.argv[1:] == ["--serve"]
if SERVE:  # before any import can print: stdout becomes the acknowledgement pipe alone
    ACK = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)

import torch  # noqa: E402 - after the stdout split above

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root

# What a freshly started rank holds, restored before each run of a `runs` job so that a run
# sees what it would as the first of its own launch.
FRESH_SEED = torch.initial_seed()
FRESH_DTYPE = torch.get_default_dtype()


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    out_dir, rank = Path(spec["out_dir"]), int(os.environ["RANK"])
    torch.set_num_threads(int(spec.get("threads", 1)))
    if "job" in spec:  # one named session instead of matrix cells
        return _run_job(spec, out_dir, rank)
    from tests.helpers.worker.cell import cell_name, run_cell

    results = {}
    for stage, dtype in spec["cells"]:
        name = cell_name(stage, spec["world"], dtype)
        try:
            completions = torch.load(spec["completions"][dtype], weights_only=False)
            results[name] = run_cell(stage, spec["world"], dtype, completions, out_dir / name)
        except Exception:  # report any failure to the parent with its cell, then stop this rank
            (out_dir / f"rank{rank}.error").write_text(f"cell {name}:\n{traceback.format_exc()}")
            return 1
        torch.save(results, out_dir / f"rank{rank}.pt")
    return 0


def _run_job(spec: dict, out_dir: Path, rank: int) -> int:
    module = importlib.import_module(spec["job"])  # a dotted name: tests.helpers.parity.packing_job
    key = spec["job"].rsplit(".", 1)[-1]
    shared = {name: value for name, value in spec.items() if name != "runs"}
    runs = spec.get("runs")
    results = []
    for index, run in enumerate(runs if runs is not None else [{}]):
        if runs is not None:
            _fresh_process_state(spec)
        try:
            results.append(module.run({**shared, **run}, out_dir, rank))
        except Exception:
            where = f"job {spec['job']}" + (f" run {index} {run.get('name', '')}" if runs else "")
            (out_dir / f"rank{rank}.error").write_text(f"{where}:\n{traceback.format_exc()}")
            return 1
        torch.save({key: results if runs is not None else results[0]}, out_dir / f"rank{rank}.pt")
    return 0


def serve() -> int:
    """Run one spec per line of stdin in this one world, each from a fresh rank's state (its
    results as in a launch of its own), until EOF or the first error (whose rank exits: the
    parent kills the rest of the world)."""
    rank = int(os.environ["RANK"])
    while line := sys.stdin.readline():
        spec_path = line.strip()
        spec = json.loads(Path(spec_path).read_text())
        with _prints_to(Path(spec["out_dir"]) / f"rank{rank}.log"):
            if not spec.get("skip_fresh_state"):  # only the guard's negative control skips it
                _fresh_process_state(spec)
            code = main(spec_path)
        if code != 0:
            return code
        ACK.write(b"done\n")
    return 0


@contextmanager
def _prints_to(log: Path):
    """This request's prints (fd 1 and 2, also C++'s) in its own log, as a launch's are."""
    sys.stdout.flush()
    sys.stderr.flush()
    server_log = os.dup(2)
    with open(log, "w") as file:
        os.dup2(file.fileno(), 1)
        os.dup2(file.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(server_log, 1)
            os.dup2(server_log, 2)
            os.close(server_log)


def _fresh_process_state(spec: dict) -> None:
    """The process-wide torch state a run may change, as a fresh rank starts with it; the
    previous run's engine and model are collected (DeepSpeed's hooks go with them)."""
    gc.collect()
    torch.manual_seed(FRESH_SEED)
    torch.set_default_dtype(FRESH_DTYPE)
    torch.set_grad_enabled(True)
    torch.set_num_threads(int(spec.get("threads", 1)))


if __name__ == "__main__":
    code = serve() if SERVE else main(sys.argv[1])
    # The rank's results (or its error) are on disk: leave without the interpreter's teardown,
    # whose C++ destructors (gloo, DeepSpeed's comm op) the parent does not need. A rank once
    # aborted with "terminate called without an active exception" (exit -6) in a fresh clone's
    # suite; where in the rank was not pinned down, and 8 reruns passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
