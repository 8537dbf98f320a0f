"""The worker matrix's cells on mixture-of-experts models, as one named session of ds_runner.py.

`run(spec, out_dir, rank)` runs tests/helpers/worker/cell.py's `run_cell` for each
[stage, dtype] of spec["cells"] on the MoE model of that dtype (`MODELS`),
with the router's auxiliary loss on, and returns {cell name: result}.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.helpers.worker.cell import cell_name, run_cell

# fp32: a dense middle layer and an expert width of 44; bf16: a shared expert behind a sigmoid
# gate, every other layer dense, width 36 (grouped_mm cannot run it).
MODELS = {"float32": "tiny-qwen3-moe", "bfloat16": "tiny-qwen2-moe"}
AUX = {"router_aux_loss_coef": 0.01, "kl_coef": 0.05}


def run_moe_cell(stage: int, world: int, dtype: str, completions, workdir: Path) -> dict:
    return run_cell(stage, world, dtype, completions, workdir, MODELS[dtype], algorithm=AUX)


def run(spec: dict, out_dir: Path, rank: int) -> dict:
    results = {}
    for stage, dtype in spec["cells"]:
        name = cell_name(stage, spec["world"], dtype)
        completions = torch.load(spec["completions"][dtype], weights_only=False)
        results[name] = run_moe_cell(stage, spec["world"], dtype, completions, out_dir / name)
    return results
