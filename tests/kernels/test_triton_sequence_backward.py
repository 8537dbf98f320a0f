"""Triton backend, the layout-invariant backward (spans + sink): on the interpreter at tiny sizes.

The harness is tests/kernels/test_sequence_backward.py's (five sequences; each alone, in one
shuffled left/right padded batch, in two micro-batches, packed; garbage in every padding
row), run with backend="triton": on a CPU under TRITON_INTERPRET=1, with a GPU on cuda
(scripts/gpu_check.sh). Its sequences are sized by the Triton kernels' constants, not by
cpp's chunks (harness.LENGTHS, which the cpp and native cases keep): the interpreter pays
per row, padding included. Two span a BLOCK_M-row tile and a remainder, the layouts move
each across tile boundaries, and for linear / lm_head (the projection's weight partial, an
exact_gemm with K = a sequence's length) the longest crosses a BLOCK_K step.
Chains checked:
- every sequence's partial of every parameter and every token's input gradient are
  torch.equal across the four layouts (per op; one dtype in `make test`, the other
  exhaustive, as the interpreter is slow);
- against the cpp backend: where both run the same torch code on the same values (the
  embedding's row sums, a linear / lm_head bias's row sums) torch.equal; where the GEMM is the backend's
  own (cpp: one fma chain per output; triton: BLOCK_K dots into an fp32 accumulator, or
  the tensor cores) the bits legitimately differ, so within fp32 rounding of cpp's; and
  `exact_gemm` itself within the fp32 summation bound of the fp64 product;
- `exact_gemm`'s row of a alone == in any batch, at any row, next to garbage.
Negative control: the plain backward (no sink) accumulated over a layout's micro-batches
gives other parameter-gradient bits in some layout. The compiled side (one binary for
every sequence length): tests/kernels/test_gpu_compile.py.
"""

from __future__ import annotations

import functools

import pytest
import torch

from rl_engine.kernels.triton._matmul import BLOCK_K, BLOCK_M, exact_gemm
from tests.helpers.kernels import sequence_backward as harness
from tests.helpers.triton_marks import DEVICE, TRITON_MARKS, dtypes_keeping

pytestmark = TRITON_MARKS

# op -> the dtype `make test` runs (the other is exhaustive): alternated across ops
KEPT = {
    "linear": torch.float32,
    "lm_head": torch.bfloat16,
    "linear_logp": torch.float32,
    "embedding": torch.bfloat16,
    "rms_norm": torch.float32,
    "moe_router": torch.bfloat16,
    "moe_experts": torch.float32,
}


SHORT = (BLOCK_M + 3, 5, BLOCK_M + 1, 1, 9)
# the projection's weight partial: exact_gemm over a sequence's tokens (K = its length), the
# longest sequence crossing a BLOCK_K step. moe_router's partial is that projection's, and
# linear_logp's the same exact_gemm over a sequence's rows (its chunk holds the whole sequence
# at V = 300): they run SHORT, as the interpreter pays per row (padding rows included)
K_IS_A_SEQUENCE = ("linear", "lm_head")


def lengths_of(op: str) -> tuple[int, ...]:
    if op in K_IS_A_SEQUENCE:
        return (max(BLOCK_K + 2, SHORT[0]), *SHORT[1:])
    return SHORT


def _params():
    return [
        pytest.param(op, p.values[0], marks=p.marks)
        for op in KEPT
        for p in dtypes_keeping(KEPT[op])
    ]


@pytest.mark.parametrize(("op", "dtype"), _params())
def test_partials_and_input_grads_do_not_depend_on_the_layout(op, dtype):
    run = functools.partial(
        harness.run_layout, op, dtype=dtype, sink=True, backend="triton", lengths=lengths_of(op)
    )
    reference, ref_grads, plain = run("alone", fill="garbage")
    assert all(g is None for g in plain.values())  # the parameters' gradients went to the sink
    roles = set(harness.ROLES[op].values())
    assert reference.keys() == {(role, index) for role in roles for index in harness.INDICES}
    if op != "embedding":
        assert ref_grads.keys() == set(range(len(harness.INDICES)))
    for layout in ("padded", "two_micro_batches", "packed"):
        records, grads, _ = run(layout, fill="garbage")
        assert records.keys() == reference.keys(), layout
        for key, partial in reference.items():
            assert harness.same_partial(records[key], partial), (layout, key)
        for i, grad in ref_grads.items():
            assert torch.equal(grads[i], grad), (layout, i)


def _cpu(value):
    return tuple(t.cpu() for t in value) if isinstance(value, tuple) else value.cpu()


@pytest.mark.parametrize("op", list(KEPT))
def test_partials_and_input_grads_match_the_cpp_backend(op):
    """fp32, packed: the same torch row sums bit for bit; the backend's own GEMMs to rounding."""
    run = functools.partial(
        harness.run_layout, op, "packed", torch.float32, sink=True, lengths=lengths_of(op)
    )
    records, grads, _ = run(fill="zeros", backend="triton")
    cpp_records, cpp_grads, _ = run(fill="zeros", backend="cpp")
    assert records.keys() == cpp_records.keys()
    for key, value in records.items():
        value, want = _cpu(value), cpp_records[key]
        # common row sums over the same upstream values (linear_logp's bias: its own softmax)
        if key[0] == "embedding" or (key[0] == "bias" and op in ("linear", "lm_head")):
            assert harness.same_partial(value, want), key
        elif isinstance(value, tuple):  # add_rows: the same rows, values to rounding
            assert torch.equal(value[0], want[0]), key
            torch.testing.assert_close(value[1], want[1], rtol=1e-4, atol=1e-5)
        else:
            torch.testing.assert_close(value, want, rtol=1e-4, atol=1e-5)
    assert grads.keys() == cpp_grads.keys()
    for i, grad in grads.items():
        torch.testing.assert_close(grad.cpu(), cpp_grads[i], rtol=1e-4, atol=1e-5)


def test_negative_control_plain_backward_depends_on_the_layout():
    """No sink: the plain backward's parameter gradients, accumulated over a layout's
    micro-batches (zero upstream gradient on padding), differ in some pair of layouts."""
    plains = [
        harness.run_layout(
            "linear",
            layout,
            torch.float32,
            sink=False,
            fill="zeros",
            backend="triton",
            lengths=lengths_of("linear"),
        )[2]
        for layout in ("alone", "padded", "two_micro_batches", "packed")
    ]
    assert any(not torch.equal(p["weight"], plains[0]["weight"]) for p in plains[1:])


def _operands(M, N, K, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    a, b = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    return a.to(dtype).to(DEVICE), b.to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("K", [1, 7, 64, 130])
def test_exact_gemm_rows_are_fixed_and_within_the_fp32_bound(dtype, K):
    """A row of a alone, in batches of 2..37 rows at any position and next to garbage: the
    same bits; against fp64 within K * 2^-24 * sum |a||b| (products exact for bf16)."""
    a, b = _operands(37, 50, K, dtype, seed=K)
    out = exact_gemm(a, b)
    assert out.dtype == torch.float32 and out.shape == (37, 50)
    for row in (0, 5, 36):
        alone = exact_gemm(a[row : row + 1], b)[0]
        assert torch.equal(out[row], alone), row
        noisy = (torch.randn(3, K) * 1e4).to(dtype).to(DEVICE)
        noisy[1] = a[row]
        assert torch.equal(exact_gemm(noisy, b)[1], alone), row
        assert torch.equal(exact_gemm(a[row:], b)[0], alone), row
    exact = a.double() @ b.double().t()
    bound = K * 2.0**-24 * (a.double().abs() @ b.double().abs().t())
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_exact_gemm_empty_chains_are_plus_zero():
    a, b = torch.empty(4, 0, device=DEVICE), torch.empty(3, 0, device=DEVICE)
    out = exact_gemm(a, b)
    assert torch.equal(out, torch.zeros(4, 3, device=DEVICE)) and not out.signbit().any()
    assert exact_gemm(torch.empty(0, 5, device=DEVICE), torch.empty(3, 5, device=DEVICE)).shape == (
        0,
        3,
    )


@pytest.mark.parametrize("op", ["linear", "lm_head", "rms_norm", "embedding"])
def test_a_sequence_without_rows_reports_zeros(op):
    harness.check_a_sequence_without_rows_reports_zeros(op, "triton")
