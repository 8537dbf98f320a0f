"""Tensor-parallel rollout engines that keep the bits of one engine (docs/scaling.md).

`TensorParallelEngine` runs on every rank of a torch.distributed group;
`launch` / `generate_tensor_parallel` start N local processes for it without
Ray. `TPLayout` is the sharding plan (output shards only; uneven shards allowed),
`shard_model` applies it. Rule: shard outputs, never reductions.
"""

from rl_engine.rollout.tp.collectives import ShardGroup
from rl_engine.rollout.tp.engine import TensorParallelEngine
from rl_engine.rollout.tp.launch import generate_tensor_parallel, launch
from rl_engine.rollout.tp.layout import (
    TENSOR_PARALLEL_SIZES,
    TPLayout,
    check_tensor_parallel_size,
)
from rl_engine.rollout.tp.shard import shard_model, shard_state_dict, tp_layout
from rl_engine.rollout.tp.sharded_linear import ShardedLinear

__all__ = [
    "TENSOR_PARALLEL_SIZES",
    "ShardGroup",
    "ShardedLinear",
    "TPLayout",
    "TensorParallelEngine",
    "check_tensor_parallel_size",
    "generate_tensor_parallel",
    "launch",
    "shard_model",
    "shard_state_dict",
    "tp_layout",
]
