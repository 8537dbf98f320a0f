"""Entry point of one DeepSpeed rank in the multi-process tests: `python ds_runner.py SPEC.json`.

The parent sets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT and
DS_ACCELERATOR=cpu. SPEC lists the cells to run in this one job (so the ranks
start and rendezvous once), the completions file of each dtype and the output
folder. After every cell the rank rewrites `rank{RANK}.pt` (torch.save of
{cell name: result}); on an error it writes `rank{RANK}.error` with the cell
and the traceback and exits 1 (the other ranks may be stuck in a collective:
the parent kills them).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))  # the repository root


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
    import importlib

    module = importlib.import_module(spec["job"])  # a dotted name: tests.helpers.parity.packing_job
    try:
        result = module.run(spec, out_dir, rank)
    except Exception:
        (out_dir / f"rank{rank}.error").write_text(f"job {spec['job']}:\n{traceback.format_exc()}")
        return 1
    torch.save({spec["job"].rsplit(".", 1)[-1]: result}, out_dir / f"rank{rank}.pt")
    return 0


if __name__ == "__main__":
    code = main(sys.argv[1])
    # The rank's results (or its error) are on disk: leave without the interpreter's teardown,
    # whose C++ destructors (gloo, DeepSpeed's comm op) the parent does not need. A rank once
    # aborted with "terminate called without an active exception" (exit -6) in a fresh clone's
    # suite; where in the rank was not pinned down, and 8 reruns passed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
