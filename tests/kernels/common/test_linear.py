"""linear / lm_head: a row's output bits do not depend on the rest of the batch.

Chain checked: op(probe alone) == op(probe inside a batch of any size, at any
row, next to any rows, garbage included) == op(probe) with 1, 2 or 3 threads.
Negative control: plain F.linear breaks the first equality on this CPU.
The invariance tests run on both CPU backends: cpp (the default) and native;
native tests skip with the platform probe's reason where it refuses the dtype
(tests/helpers/invariance.py::skip_if_refused). The native tile scheme's own tests are in
tests/kernels/native/test_tiles.py. The shared `Projection` (common/linear.py): its no-gradient path has
the autograd path's forward bits, and one built without an exact GEMM refuses the
layout-invariant mode by name.
"""

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import get_op
from rl_engine.kernels.common.linear import projection
from rl_engine.kernels.common.sequence_spans import SequenceSpans
from rl_engine.kernels.cpp.linear import linear_forward as cpp_linear_forward
from tests.helpers.invariance import (
    assert_equal_across_threads,
    garbage_like,
    probe_batches,
    skip_if_refused,
)
from tests.helpers.kernels.sequence_backward import RecordingSink

DTYPES = [torch.float32, torch.bfloat16]
# (K, N): odd sizes, SmolLM2's projections, and K > 1024 (sliced reduction)
SHAPES = [(96, 1000), (576, 1536), (1536, 576), (2500, 300)]
BATCH_SIZES = [1, 2, 3, 7, 16, 17, 64, 301, 4096]

BACKENDS = ["cpp", "native"]

linear = get_op("linear", "cpu")
lm_head = get_op("lm_head", "cpu")


def _weights(k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x_pool = torch.randn(512, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype)
    return x_pool, w, b


def _backend_shapes() -> list:
    """Every shape on cpp (the default); native (a fallback) on the odd and the sliced-reduction
    shape in make test, on SmolLM2's two in the exhaustive tier (6-13 s a case there)."""
    cases = [pytest.param("cpp", k, n) for k, n in SHAPES]
    for k, n in SHAPES:
        smollm2_shape = (k, n) in ((576, 1536), (1536, 576))
        cases.append(pytest.param("native", k, n, marks=[pytest.mark.exhaustive] * smollm2_shape))
    return cases


@pytest.mark.parametrize(("backend", "k", "n"), _backend_shapes())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op_name", ["linear", "lm_head"])
def test_row_bits_independent_of_batch(op_name, k, n, dtype, backend):
    skip_if_refused(backend, dtype)
    op = get_op(op_name, "cpu", backend=backend)
    pool, w, b = _weights(k, n, dtype)
    probe = pool[7]
    alone = op(probe[None], w, b)[0]
    for batch, row in probe_batches(probe, pool, BATCH_SIZES if k * n < 1e6 else BATCH_SIZES[:-1]):
        assert torch.equal(op(batch, w, b)[row], alone), f"batch of {batch.shape[0]}, row {row}"
        batch_g = garbage_like(batch)
        batch_g[row] = probe
        assert torch.equal(op(batch_g, w, b)[row], alone), "garbage in other rows changed the probe"
        perm = torch.randperm(batch.shape[0])
        assert torch.equal(op(batch[perm], w, b)[(perm == row).nonzero().item()], alone)


def test_leading_dims_are_rows():
    pool, w, b = _weights(96, 1000, torch.float32)
    x = pool[:24].reshape(2, 3, 4, 96)
    assert torch.equal(linear(x, w, b).reshape(24, -1), linear(pool[:24], w, b))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_output_dtypes_and_accuracy(dtype, backend):
    skip_if_refused(backend, dtype)
    pool, w, b = _weights(2500, 300, dtype)
    ref = pool.double() @ w.double().t() + b.double()
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    out = get_op("linear", "cpu", backend=backend)(pool, w, b)
    assert out.dtype == dtype
    torch.testing.assert_close(out.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    logits = get_op("lm_head", "cpu", backend=backend)(pool, w, b)
    assert logits.dtype == torch.float32
    torch.testing.assert_close(logits.double(), ref, atol=tol * ref.abs().max().item(), rtol=0)


def test_negative_control_plain_linear_is_not_invariant():
    """One row alone takes a GEMV path in plain torch: its bits differ from the same row in a batch."""
    pool, w, _ = _weights(576, 1536, torch.float32)
    alone = F.linear(pool[:1], w)[0]
    in_batch = F.linear(pool[:64], w)[0]
    assert not torch.equal(alone, in_batch), (
        "plain F.linear became batch-invariant: re-check the negative control"
    )


@pytest.mark.multiprocess
@pytest.mark.threads
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_thread_count_invariance(dtype, backend):
    skip_if_refused(backend, dtype)
    code = f"""
    from rl_engine.kernels import get_op
    g = torch.Generator().manual_seed(0)
    result = {{}}
    linear = get_op("linear", "cpu", backend="{backend}")
    lm_head = get_op("lm_head", "cpu", backend="{backend}")
    for k, n in [(96, 1000), (1536, 576), (2500, 300), (4096, 512)]:
        x = torch.randn(33, k, generator=g).to(torch.{dtype})
        w = (torch.randn(n, k, generator=g) / k**0.5).to(torch.{dtype})
        result[f"linear{{k}}x{{n}}"] = linear(x, w)
        result[f"single{{k}}x{{n}}"] = linear(x[:1], w)
        result[f"lm_head{{k}}x{{n}}"] = lm_head(x, w)
    """
    out = assert_equal_across_threads(code)
    for key in out:
        if key.startswith("single"):
            assert torch.equal(out[key][0], out[key.replace("single", "linear")][0])


@pytest.mark.parametrize(
    "dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-4), (torch.bfloat16, 5e-2)]
)
def test_backward_matches_reference_and_is_deterministic(dtype, tol):
    # fp64 runs cpp's torch GEMM, which is not row-invariant: the test opts in to it
    linear = get_op("linear", "cpu", allow_non_invariant=dtype == torch.float64)
    pool, w, b = _weights(1500, 70, dtype)
    x = pool[:9]

    def grads(fn):
        xs, ws, bs = (t.clone().requires_grad_(True) for t in (x, w, b))
        fn(xs, ws, bs).float().pow(2).sum().backward()
        return xs.grad, ws.grad, bs.grad

    ours, again = grads(linear), grads(linear)
    ref = grads(lambda a, c, d: F.linear(a.double(), c.double(), d.double()))
    for g_ours, g_again, g_ref in zip(ours, again, ref):
        assert torch.equal(g_ours, g_again)
        scale = g_ref.abs().max().item()
        torch.testing.assert_close(g_ours.double(), g_ref.double(), atol=tol * scale, rtol=0)


def test_gradcheck_fp64():
    linear = get_op("linear", "cpu", allow_non_invariant=True)  # cpp's fp64 is not invariant
    x = torch.randn(3, 20, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, 20, dtype=torch.float64, requires_grad=True)
    b = torch.randn(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, c, d: linear(a, c, d), (x, w, b))


def test_empty_batch_keeps_autograd():
    _, w, b = _weights(96, 1000, torch.float32)
    w = w.clone().requires_grad_(True)
    x = torch.zeros(0, 96, requires_grad=True)
    out = linear(x, w, b)
    assert out.shape == (0, 1000)
    out.sum().backward()
    assert x.grad.shape == (0, 96) and torch.equal(w.grad, torch.zeros_like(w))


def test_bad_inputs_name_the_problem():
    _, w, _ = _weights(96, 1000, torch.float32)
    with pytest.raises(ValueError, match="x has last dim 95"):
        linear(torch.randn(2, 95), w)
    with pytest.raises(TypeError, match="x must be a floating-point tensor"):
        linear(torch.ones(2, 96, dtype=torch.long), w)
    with pytest.raises(TypeError, match="x is torch.bfloat16 but weight is torch.float32"):
        linear(torch.randn(2, 96, dtype=torch.bfloat16), w)
    with pytest.raises(ValueError, match="bias must have shape"):
        linear(torch.randn(2, 96), w, torch.zeros(3))


def test_projection_without_a_gradient_skips_autograd_with_the_same_forward_bits():
    project = projection(cpp_linear_forward, "tests.kernels.common.test_linear")
    pool, w, b = _weights(96, 100, torch.float32)
    x = pool[:5]
    with torch.no_grad():
        plain = project(x, w, b)
    tracked = project(x.clone().requires_grad_(True), w, b)
    assert plain.grad_fn is None and tracked.grad_fn is not None
    assert torch.equal(plain, tracked.detach())


def test_projection_without_an_exact_gemm_refuses_the_sequence_mode():
    project = projection(cpp_linear_forward, "tests.kernels.common.test_linear")
    x = torch.randn(2, 3, 8)
    spans = SequenceSpans(6, (0, 3), (3, 3), (0, 1))
    assert project.sequence_function is None
    project.check_sequence_mode("linear", x, None, None)  # the plain mode needs no gemm
    with pytest.raises(
        NotImplementedError, match="linear: this backend .* has no layout-invariant"
    ):
        project.check_sequence_mode("linear", x, spans, RecordingSink())
    with pytest.raises(ValueError, match="linear: spans describe 6 rows but the input has 4 rows"):
        project.check_sequence_mode("linear", x[:, :2], spans, RecordingSink())
