"""One DeepSpeed rank of the layout-free update tests (`run_ranks` with spec["job"] = this module).

A small model (an embedding and projections of odd sizes, so ZeRO cuts parameters at awkward
places) is built on every rank from one seed, stepped `spec["steps"]` times with the same whole
gradients on every layout (drawn from a seed per step, with a scale that makes the clip act),
then its layout-free state is gathered. spec: stage, dtype, steps, first_step (a resumed run's
first step number), optimizer ("invariant": InvariantAdamW + the layout-free clip; "torch":
torch AdamW + DeepSpeed's own clip, the plain path), resume (a state file to restore first).
"""

from __future__ import annotations

from pathlib import Path

import deepspeed
import torch

from rl_engine.executors.worker.optim.layout_free_adamw import InvariantAdamW
from rl_engine.executors.worker.layout_free.grads import (
    clip_coefficient,
    global_norm,
    inject_gradients,
)
from rl_engine.executors.worker.layout_free.state import gather_state, restore_state

MAX_NORM = 1.0


class Small(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(97, 24)
        self.up = torch.nn.Linear(24, 61)
        self.down = torch.nn.Linear(61, 24, bias=False)
        self.head = torch.nn.Linear(24, 97, bias=False)

    def forward(self, ids):
        return self.head(self.down(torch.relu(self.up(self.embed(ids)))))


def _engine(spec: dict, world: int):
    torch.manual_seed(0)
    model = Small()
    invariant = spec["optimizer"] == "invariant"
    make = InvariantAdamW if invariant else torch.optim.AdamW
    optimizer = make(model.parameters(), lr=1e-2, weight_decay=0.1)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world,
        "gradient_clipping": 0.0 if invariant else MAX_NORM,
        "zero_optimization": {"stage": spec["stage"]},
        "zero_allow_untested_optimizer": True,
    }
    if spec["dtype"] == "bfloat16":
        config["bf16"] = {"enabled": True}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _whole_gradients(params, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1000 + step)
    shapes = [tuple(getattr(p, "ds_shape", p.shape)) for p in params]
    return [torch.randn(shape, generator=generator) * 3.0 for shape in shapes]


def _step(engine, spec: dict, step: int) -> float:
    params = [p for p in engine.module.parameters() if p.requires_grad]
    ids = torch.arange(5).reshape(1, 5)
    engine.backward(engine(ids).sum() * 0.0)  # DeepSpeed's partitions exist after a backward
    dtype = params[0].dtype
    grads = [g.to(dtype) for g in _whole_gradients(params, step)]
    norm = global_norm(grads)
    if spec["optimizer"] == "invariant":
        base = getattr(engine.optimizer, "optimizer", engine.optimizer)
        base.arm(clip_coefficient(norm, MAX_NORM))
    inject_gradients(params, grads)
    engine.step()
    return norm


def run(spec: dict, out_dir: Path, rank: int) -> dict:
    deepspeed.init_distributed(dist_backend="gloo")
    engine = _engine(spec, int(spec["world"]))
    if spec.get("resume"):
        restore_state(engine, torch.load(spec["resume"]))
    first = int(spec.get("first_step", 0))
    norms = [_step(engine, spec, step) for step in range(first, first + spec["steps"])]
    state = gather_state(engine)
    if rank == 0 and spec.get("save"):
        torch.save(state, spec["save"])
    return {"state": state, "norms": norms}
