"""The critic tests' shared config and GAE returns (tiny Llama, fp32, the cell's completions)."""

from __future__ import annotations

import torch

from rl_engine.algorithms import compute_advantages
from rl_engine.config import RunConfig
from rl_engine.executors.worker.batch import TrainBatch
from tests.helpers.worker.cell import GROUP, cell_config


def critic_config(trainer: dict | None = None, critic: dict | None = None, **top) -> RunConfig:
    """A ppo config of the cell's completions; `trainer` / `critic` update those sections."""
    data = cell_config(0, 1, "float32", algorithm={"name": "ppo", "kl_coef": 0.0}).to_dict()
    data["trainer"].update(trainer or {})
    data["critic"] = {"lr": 1e-3, "value_clip": 0.2, **(critic or {})}
    data.update(top)
    return RunConfig.from_dict(data)


def gae_returns(batch: TrainBatch, values: torch.Tensor) -> torch.Tensor:
    """GAE's returns (advantages + values) of `batch` at gamma = lam = 1."""
    groups = torch.arange(batch.num_sequences) // GROUP
    mask = batch.response_mask
    advantages = compute_advantages("gae", batch.rewards, groups, mask=mask, values=values)
    return torch.where(mask, advantages + values, 0.0)
