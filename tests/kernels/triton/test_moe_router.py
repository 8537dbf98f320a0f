"""Triton backend, MoE ops and sigmoid: the contracts of tests/kernels/common/test_moe_router.py,
test_moe_experts.py and test_elementwise.py (sigmoid), on the interpreter.

On a CPU these run under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) at tiny shapes; with a GPU the same tests run the compiled
kernels. Chains checked with torch.equal: the router's logits, weights and
expert ids of a token alone == its row in batches of 1..17 (garbage rows
included); a tie between two identical expert rows goes to the lower index;
the experts' output of a token alone == its row in any batch, and == HF's
eager loop run with the triton linear and silu. Gradcheck in fp64.

Under the interpreter `tl.dot` is numpy's matmul, and on some CPUs (OpenBLAS's
Haswell sgemm kernel, AVX2 machines) its rows 6-11 of a 16-row tile are summed
differently from rows 0-5: the triton `linear` is then not row-invariant on
that CPU's interpreter (tests/kernels/test_triton_ops.py fails there too). The
tests whose chain goes through `linear` skip with that reason when a probe
shows it; the routing kernel and the combine are checked on every machine.
"""

import pytest
import torch

from rl_engine.kernels import get_op
from tests.helpers.invariance import garbage_like, probe_batches, skip_if_refused
from tests.helpers.kernels.moe import hf_eager_experts
from tests.helpers.triton_marks import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
DTYPES = [torch.float32, torch.bfloat16]


def op(name):
    return get_op(name, DEVICE, backend="triton")


def _dot_rows_invariant() -> bool:
    """Whether the triton linear gives one row the same bits at every position of a tile."""
    probe = _randn(1, 64, seed=99)
    weight = _randn(128, 64, seed=98)
    rows = op("linear")(probe.expand(16, -1).contiguous(), weight)
    return bool((rows == rows[0]).all())


def _require_invariant_dot() -> None:
    if DEVICE == "cpu" and not _dot_rows_invariant():
        pytest.skip(
            "the interpreter's tl.dot (numpy's BLAS) sums rows by their position in the tile "
            "on this CPU: the triton linear is not row-invariant here"
        )


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_routing_kernel_rows_invariant_and_ties_to_the_lowest_index(dtype):
    from rl_engine.kernels.triton.moe_router import route_forward

    pool = _randn(40, 6, dtype=dtype, seed=2, scale=3.0)
    pool[:, 4] = pool[:, 1]  # an exact tie in every row
    probe = pool[3]
    alone = route_forward(probe[None], 6, True, dtype)
    for batch, row in probe_batches(probe.cpu(), pool.cpu(), [1, 2, 17]):
        noisy = garbage_like(batch)
        noisy[row] = probe.cpu()
        for layout in (batch, noisy):
            out = route_forward(layout.to(DEVICE), 6, True, dtype)
            for got, ref in zip(out, alone):
                assert torch.equal(got[row], ref[0]), f"batch of {batch.shape[0]}, row {row}"
    _, indices, _, _ = route_forward(pool, 6, False, dtype)
    first = lambda e: (indices == e).int().argmax(1)  # noqa: E731
    assert bool((first(1) < first(4)).all())
    _, idx, _, _ = route_forward(torch.zeros_like(pool[:5]), 3, True, dtype)
    assert torch.equal(idx.cpu(), torch.arange(3).expand(5, -1))


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_router_rows_invariant(dtype):
    _require_invariant_dot()
    router = op("moe_router")
    weight = _randn(6, 40, dtype=dtype, seed=1)
    weight[4] = weight[1]  # an exact tie in every row
    pool = _randn(40, 40, dtype=dtype, seed=2)
    probe = pool[3]
    alone = router(probe[None], weight, 6, renormalize=True)
    for batch, row in probe_batches(probe.cpu(), pool.cpu(), [1, 2, 17]):
        noisy = garbage_like(batch)
        noisy[row] = probe.cpu()
        for layout in (batch, noisy):
            out = router(layout.to(DEVICE), weight, 6, renormalize=True)
            for got, ref in zip(out, alone):
                assert torch.equal(got[row], ref[0]), f"batch of {batch.shape[0]}, row {row}"


def test_router_matches_the_native_router():
    skip_if_refused("native", torch.float32)
    router = op("moe_router")
    weight = _randn(6, 40, seed=1)
    pool = _randn(40, 40, seed=2)
    ref = get_op("moe_router", "cpu", backend="native")(pool.cpu().float(), weight.cpu().float(), 2)
    got = router(pool.float(), weight.float(), 2)
    torch.testing.assert_close(got[1].cpu(), ref[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_experts_equal_hf_eager_loop_with_the_triton_linear_and_silu(dtype):
    experts = op("moe_experts")
    gate_up = _randn(5, 2 * 9, 24, dtype=dtype, seed=3, scale=0.3)
    down = _randn(5, 24, 9, dtype=dtype, seed=4, scale=0.3)
    hidden = _randn(20, 24, dtype=dtype, seed=5)
    _, weights, indices = op("moe_router")(hidden, _randn(5, 24, dtype=dtype, seed=6), 2)
    full = experts(hidden, gate_up, down, indices, weights)
    ref = hf_eager_experts(hidden, gate_up, down, indices, weights, op("linear"), op("silu"))
    assert torch.equal(full, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_experts_token_invariant(dtype):
    _require_invariant_dot()
    experts = op("moe_experts")
    gate_up = _randn(5, 2 * 9, 24, dtype=dtype, seed=3, scale=0.3)
    down = _randn(5, 24, 9, dtype=dtype, seed=4, scale=0.3)
    hidden = _randn(20, 24, dtype=dtype, seed=5)
    _, weights, indices = op("moe_router")(hidden, _randn(5, 24, dtype=dtype, seed=6), 2)
    full = experts(hidden, gate_up, down, indices, weights)
    for row in (0, 13):
        alone = experts(
            hidden[row : row + 1], gate_up, down, indices[row : row + 1], weights[row : row + 1]
        )
        assert torch.equal(full[row], alone[0])


def test_gradcheck_fp64():
    router, experts = op("moe_router"), op("moe_experts")
    hidden = _randn(3, 6, dtype=torch.float64, seed=7).requires_grad_()
    weight = _randn(4, 6, dtype=torch.float64, seed=8).requires_grad_()
    gate_up = _randn(4, 6, 6, dtype=torch.float64, seed=9, scale=0.5).requires_grad_()
    down = _randn(4, 6, 3, dtype=torch.float64, seed=10, scale=0.5).requires_grad_()

    def layer(h, w, gu, d):
        logits, weights, indices = router(h, w, 2, renormalize=True)
        return experts(h, gu, d, indices, weights), logits

    assert torch.autograd.gradcheck(layer, (hidden, weight, gate_up, down), fast_mode=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sigmoid_position_invariant_and_accurate(dtype):
    sigmoid = op("sigmoid")
    x = _randn(2051, dtype=dtype, seed=11, scale=4.0)
    full = sigmoid(x)
    assert torch.equal(torch.cat([sigmoid(x[i : i + 7]) for i in range(0, 70, 7)]), full[:70])
    torch.testing.assert_close(full.double(), torch.sigmoid(x.double()), atol=1e-2, rtol=1e-2)
    g = x[:9].double().requires_grad_()
    assert torch.autograd.gradcheck(sigmoid, (g,))
