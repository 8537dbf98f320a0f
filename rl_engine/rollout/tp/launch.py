"""Run a tensor-parallel engine without Ray: N local processes started with torch.multiprocessing.

    from functools import partial
    from rl_engine.rollout.tp import generate_tensor_parallel
    completions = generate_tensor_parallel(
        partial(build_my_patched_model), prompts, SamplingParams(max_new_tokens=16),
        tensor_parallel_size=2,
    )

`launch(fn, tensor_parallel_size)` is the general form: each of N spawned
processes initialises torch.distributed (gloo on cpu, NCCL on cuda, rank r on
cuda:r), limits itself to `threads_per_rank` intra-op threads and calls
`fn(rank, world)`; rank 0's return value comes back. `fn` and its arguments
must be picklable (a module-level function, `functools.partial`). To embed the
engine in another framework, do what `_rank_main` does in your own processes.
"""

from __future__ import annotations

import io
import os
import tempfile
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rl_engine.base.io import write_bytes_atomic
from rl_engine.rollout.sampling import SamplingParams
from rl_engine.rollout.tp.layout import check_tensor_parallel_size

RESULT_FILE = "rank0_result.pt"


def launch(
    fn: Callable[[int, int], object],
    tensor_parallel_size: int,
    *,
    device: str = "cpu",
    threads_per_rank: int = 1,
) -> object:
    """Run `fn(rank, world)` in `tensor_parallel_size` new processes of one process group;
    returns rank 0's result. A failure on any rank raises here (torch.multiprocessing's
    ProcessRaisedException, with that rank's traceback)."""
    world = check_tensor_parallel_size(tensor_parallel_size)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if not isinstance(threads_per_rank, int) or threads_per_rank < 1:
        raise ValueError(f"threads_per_rank must be an int >= 1, got {threads_per_rank!r}")
    with tempfile.TemporaryDirectory(prefix="rl_engine_tp_") as tmp:
        args = (world, fn, device, threads_per_rank, tmp)
        mp.start_processes(_rank_main, args=args, nprocs=world, join=True, start_method="spawn")
        return torch.load(Path(tmp) / RESULT_FILE, weights_only=False)


def generate_tensor_parallel(
    build_model: Callable[[], torch.nn.Module],
    prompts: Sequence[Sequence[int]],
    sampling: SamplingParams | None = None,
    *,
    tensor_parallel_size: int,
    device: str = "cpu",
    threads_per_rank: int = 1,
    **engine_kwargs,
):
    """Completions of `prompts` from a TP engine over `tensor_parallel_size` local processes.

    build_model(): the same model (weights, dtype, patching) on every rank, on `device`
    (each rank calls it; cuda ranks have their own device current). engine_kwargs go to
    `TensorParallelEngine` (max_batch_size, max_seq_len, weight_version,
    share_prompt_prefill)."""
    prompts = [list(p) for p in prompts]
    fn = partial(_generate, build_model, prompts, sampling, device, engine_kwargs)
    return launch(fn, tensor_parallel_size, device=device, threads_per_rank=threads_per_rank)


def _generate(build_model, prompts, sampling, device, engine_kwargs, rank: int, world: int):
    from rl_engine.rollout.tp.engine import TensorParallelEngine

    model = build_model()
    place = f"cuda:{rank}" if device == "cuda" else "cpu"
    engine = TensorParallelEngine(model, device=place, **engine_kwargs)
    return engine.generate(prompts, sampling)


def _rank_main(rank: int, world: int, fn, device: str, threads: int, tmp: str) -> None:
    torch.set_num_threads(threads)
    if device == "cuda":
        torch.cuda.set_device(rank)
    backend = "nccl" if device == "cuda" else "gloo"
    store = f"file://{os.path.join(tmp, 'rendezvous')}"
    dist.init_process_group(backend, init_method=store, rank=rank, world_size=world)
    try:
        result = fn(rank, world)
        if rank == 0:
            buffer = io.BytesIO()
            torch.save(result, buffer)
            write_bytes_atomic(Path(tmp) / RESULT_FILE, buffer.getvalue())
        dist.barrier()
    finally:
        dist.destroy_process_group()
