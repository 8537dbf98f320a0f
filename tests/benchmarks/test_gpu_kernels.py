"""`rl-engine bench kernels --device cuda` (rl_engine/benchmarks/gpu_kernels.py): the Triton
backend against cuBLAS / SDPA on a GPU; without one it refuses.

Nothing is asserted about speed: the figures of a tiny run mean nothing."""

from __future__ import annotations

import pytest
import torch

from rl_engine import cli
from rl_engine.benchmarks import gpu_kernels
from tests.helpers.bench_tables import assert_figures, bench, bench_modules


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_kernels_cuda_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["bench", "kernels", "--device", "cuda", "--tiny"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_kernels_cuda(capsys):
    (rows,) = bench(capsys, "kernels", "--device", "cuda")
    assert [r["op"] for r in rows] == [
        "matmul",
        "matmul",
        "matmul",
        "attention prefill",
        "attention decode",
        "linear_logp",
        "linear_logp peak MiB",
        "train step fwd+bwd",
    ]
    assert_figures(rows, ratios=("ratio",))


def test_the_case_runs_this_module():
    assert "gpu_kernels" in bench_modules("kernels", None, device="cuda")
    assert callable(gpu_kernels.main)
