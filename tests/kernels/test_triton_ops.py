"""Triton backend, row-wise ops: the native contracts, bit for bit invariant, on the interpreter.

On a CPU these run under Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py) at tiny shapes; with a GPU the same tests run the compiled
kernels. Chains checked, always with torch.equal:
- linear / lm_head / rms_norm / log_softmax: op(probe alone) == op(probe in a
  batch of 1..N rows, at any row, next to garbage rows, rows permuted);
- linear_logp == log_softmax(lm_head(h), T) gathered (fused == unfused), for
  any chunk size, and == the rollout's scoring of one token alone;
- silu / embedding: elementwise / gather, equal wherever the element sits.
Accuracy: against fp64 references (tolerance). Negative controls: a reduction
order that follows the call (another K step, another row chunk) changes the
bits, and the plain torch path (F.linear + torch.log_softmax) differs.
"""

import importlib

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import get_op
from tests.helpers.invariance import garbage_like, probe_batches
from tests.helpers.triton_marks import DEVICE, TRITON_MARKS

pytestmark = TRITON_MARKS
DTYPES = [torch.float32, torch.bfloat16]
BATCH_SIZES = [1, 2, 17]  # 17: a BLOCK_M (16) row tile and a remainder on the interpreter


def op(name):
    return get_op(name, DEVICE, backend="triton")


def module(name):
    # the package re-exports each op under its file's name; fetch the file itself
    return importlib.import_module(f"rl_engine.kernels.triton.{name}")


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype).to(DEVICE)


def _assert_rows_invariant(call, pool):
    """call(batch) row of the probe == call(probe alone), in every batch layout."""
    probe = pool[3]
    alone = call(probe[None])[0]
    for batch, row in probe_batches(probe.cpu(), pool.cpu(), BATCH_SIZES):
        batch = batch.to(DEVICE)
        assert torch.equal(call(batch)[row], alone), f"batch of {batch.shape[0]}, row {row}"
        noisy = garbage_like(batch.cpu()).to(DEVICE)
        noisy[row] = probe
        assert torch.equal(call(noisy)[row], alone), "garbage in other rows changed the probe"
        perm = torch.randperm(batch.shape[0], device=DEVICE)
        assert torch.equal(call(batch[perm])[(perm == row).nonzero().item()], alone)
    return alone


# ----------------------------------------------------------------------------- linear, lm_head


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k,n", [(96, 200), (300, 130)])
@pytest.mark.parametrize("op_name", ["linear", "lm_head"])
def test_projection_rows_independent_of_batch(op_name, k, n, dtype):
    pool = _randn(64, k, dtype=dtype)
    w, b = _randn(n, k, dtype=dtype, seed=1, scale=k**-0.5), _randn(n, dtype=dtype, seed=2)
    _assert_rows_invariant(lambda x: op(op_name)(x, w, b), pool)


@pytest.mark.parametrize("dtype", DTYPES)
def test_projection_dtypes_and_accuracy(dtype):
    x, w, b = _randn(37, 300, dtype=dtype), _randn(70, 300, dtype=dtype, seed=1), _randn(70, seed=2)
    b = b.to(dtype)
    ref = x.double() @ w.double().t() + b.double()
    tol = (1e-5 if dtype == torch.float32 else 1e-2) * ref.abs().max().item()
    out, logits = op("linear")(x, w, b), op("lm_head")(x, w, b)
    assert out.dtype == dtype and logits.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    torch.testing.assert_close(logits.double(), ref, atol=tol, rtol=0)
    assert torch.equal(op("linear")(x.reshape(37, 1, 300), w, b).reshape(37, 70), out)
    assert op("linear")(x[:0], w, b).shape == (0, 70)


def test_gpu_tile_sizes_keep_rows_invariant(monkeypatch):
    """The GPU's tiles (128 x 128, K step 64) on the interpreter: M = 1 row == that row of M = 150."""
    matmul = importlib.import_module("rl_engine.kernels.triton._matmul")
    for name, value in (("BLOCK_M", 128), ("BLOCK_N", 128), ("BLOCK_K", 64)):
        monkeypatch.setattr(matmul, name, value)
    x, w = _randn(150, 200), _randn(130, 200, seed=1)
    full = op("lm_head")(x, w)
    for row in (0, 77, 149):
        assert torch.equal(op("lm_head")(x[row : row + 1], w)[0], full[row])


def test_negative_control_reduction_order_that_follows_the_call_changes_bits(monkeypatch):
    """Another K step (as a library's split-K or GEMV heuristics pick per shape) changes row bits:
    the fixed BLOCK_K is what makes the kernel invariant. Plain F.linear differs too."""
    matmul = importlib.import_module("rl_engine.kernels.triton._matmul")
    x, w = _randn(32, 1000), _randn(64, 1000, seed=1)
    fixed = op("lm_head")(x, w)
    monkeypatch.setattr(matmul, "BLOCK_K", matmul.BLOCK_K // 2)
    assert not torch.equal(op("lm_head")(x, w), fixed)
    assert not torch.equal(F.linear(x, w), fixed)


def test_projection_backward_is_deterministic_and_exact_in_fp64():
    x = _randn(2, 9, dtype=torch.float64).requires_grad_()
    w = _randn(3, 9, dtype=torch.float64, seed=1).requires_grad_()
    b = _randn(3, dtype=torch.float64, seed=2).requires_grad_()
    assert torch.autograd.gradcheck(lambda *t: op("linear")(*t), (x, w, b))
    grads = []
    for _ in range(2):
        x.grad = None
        op("lm_head")(x, w, b).pow(2).sum().backward()
        grads.append(x.grad.clone())
    assert torch.equal(grads[0], grads[1])


# ----------------------------------------------------------------------------- rms_norm, log_softmax, silu


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_rows_invariant_and_accurate(dtype):
    pool, weight = _randn(64, 300, dtype=dtype), _randn(300, dtype=dtype, seed=1)
    alone = _assert_rows_invariant(lambda x: op("rms_norm")(x, weight, 1e-6), pool)
    assert alone.dtype == dtype
    x = pool.double()
    ref = weight.double() * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(op("rms_norm")(pool, weight, 1e-6).double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize(
    ("dtype", "temperature"),
    [
        (torch.float32, 1.0),
        (torch.bfloat16, 0.7),
        # each dtype at one temperature in make test (the interpreter: ~5 s a case)
        pytest.param(torch.float32, 0.7, marks=pytest.mark.exhaustive),
        pytest.param(torch.bfloat16, 1.0, marks=pytest.mark.exhaustive),
    ],
)
def test_log_softmax_rows_invariant_and_accurate(dtype, temperature):
    pool = _randn(64, 2500, dtype=dtype, scale=3.0)
    alone = _assert_rows_invariant(lambda x: op("log_softmax")(x, temperature), pool)
    assert alone.dtype == torch.float32
    ref = torch.log_softmax(pool.double() / temperature, -1)
    torch.testing.assert_close(
        op("log_softmax")(pool, temperature).double(), ref, atol=1e-5, rtol=0
    )


def test_negative_control_row_chunk_that_follows_the_call_changes_bits(monkeypatch):
    """log_softmax and rms_norm sum each row in fixed chunks; other chunks give other bits."""
    logits, x, w = _randn(16, 2500, scale=3.0), _randn(16, 3000), _randn(3000, seed=1)
    fixed_lsm, fixed_rms = op("log_softmax")(logits), op("rms_norm")(x, w, 1e-6)
    monkeypatch.setattr(module("log_softmax"), "_BLOCK", 512)
    monkeypatch.setattr(module("rms_norm"), "_MAX_BLOCK", 128)
    assert not torch.equal(op("log_softmax")(logits), fixed_lsm)
    assert not torch.equal(op("rms_norm")(x, w, 1e-6), fixed_rms)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_elementwise_position_invariant_and_accurate(dtype):
    x = _randn(2 * 1024 + 37, dtype=dtype, scale=4.0)
    full = op("silu")(x)
    assert full.dtype == dtype
    for i in (0, 1023, 1024, 2047, x.numel() - 1):
        assert torch.equal(op("silu")(x[i : i + 1])[0], full[i])
    assert torch.equal(op("silu")(x[5:900].reshape(5, 179)), full[5:900].reshape(5, 179))
    ref = x.double() * torch.sigmoid(x.double())
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(full.double(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("op_name", ["rms_norm", "silu", "log_softmax"])
def test_rowwise_backward_matches_reference(op_name):
    weight = _randn(12, dtype=torch.float64, seed=3) + 2.0
    call = {
        "rms_norm": lambda x: op("rms_norm")(x, weight, 1e-6),
        "silu": op("silu"),
        "log_softmax": lambda x: op("log_softmax")(x, 0.7),
    }[op_name]
    x = _randn(2, 12, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(call, (x,))


# ----------------------------------------------------------------------------- embedding


def test_embedding_is_an_exact_gather_with_checked_ids():
    w = _randn(50, 24, dtype=torch.bfloat16)
    ids = torch.tensor([[3, 49, 0], [7, 7, 1]], device=DEVICE)
    out = op("embedding")(ids, w)
    assert out.dtype == torch.bfloat16 and torch.equal(out, w[ids])
    with pytest.raises(ValueError, match="token ids out of range: min 0, max 50"):
        op("embedding")(torch.tensor([0, 50], device=DEVICE), w)
    w32 = w.float().requires_grad_()
    op("embedding")(ids, w32, padding_idx=7).sum().backward()
    ref = w.float().requires_grad_()
    F.embedding(ids, ref, padding_idx=7).sum().backward()
    assert torch.equal(w32.grad, ref.grad)


# ----------------------------------------------------------------------------- linear_logp


def _logp_problem(n, hidden, vocab, dtype, bias=False):
    h = _randn(n, hidden, dtype=dtype)
    w = _randn(vocab, hidden, dtype=dtype, seed=1, scale=hidden**-0.5)
    b = _randn(vocab, dtype=dtype, seed=2) if bias else None
    g = torch.Generator().manual_seed(3)
    return h, w, b, torch.randint(0, vocab, (n,), generator=g).to(DEVICE)


def _unfused(h, w, b, t, temperature):
    """How the rollout engine scores a token: lm_head, log_softmax, gather."""
    logp = op("log_softmax")(op("lm_head")(h, w, b), temperature)
    return logp.gather(-1, t[:, None]).squeeze(-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk_elements", [1, 20000, 1 << 24])
def test_linear_logp_fused_equals_unfused(monkeypatch, dtype, chunk_elements):
    monkeypatch.setattr(module("linear_logp"), "CHUNK_ELEMENTS", chunk_elements)
    h, w, b, t = _logp_problem(37, 96, 1000, dtype, bias=True)
    fused = op("linear_logp")(h, w, t, b, temperature=0.7)
    assert fused.dtype == torch.float32 and fused.shape == t.shape
    assert torch.equal(fused, _unfused(h, w, b, t, 0.7))
    assert torch.equal(fused[5:6], _unfused(h[5:6], w, b, t[5:6], 0.7))  # one token alone


def test_linear_logp_ignore_index_accuracy_and_gradients():
    h, w, _, t = _logp_problem(12, 40, 300, torch.float64)
    t = t.reshape(3, 4).clone()
    t[0, :2] = -100
    out = op("linear_logp")(h.reshape(3, 4, 40), w, t)
    assert out.shape == (3, 4) and torch.equal(out[0, :2], torch.zeros(2, dtype=out.dtype))
    ref = torch.log_softmax(h @ w.t(), -1).gather(-1, t.reshape(-1, 1).clamp(min=0)).reshape(3, 4)
    torch.testing.assert_close(out[0, 2:], ref[0, 2:])
    torch.testing.assert_close(out[1:], ref[1:])
    # gradients against autograd through the fp64 reference
    tt = t.reshape(-1).clamp(min=0)
    hg, wg = h.clone().requires_grad_(), w.clone().requires_grad_()
    op("linear_logp")(hg, wg, tt, temperature=0.7).sum().backward()
    hr, wr = h.clone().requires_grad_(), w.clone().requires_grad_()
    torch.log_softmax(hr @ wr.t() / 0.7, -1).gather(-1, tt[:, None]).sum().backward()
    torch.testing.assert_close(hg.grad, hr.grad)
    torch.testing.assert_close(wg.grad, wr.grad)


def test_negative_control_plain_path_differs_from_fused():
    """F.linear + torch.log_softmax (the plain path) is not the triton logprob definition."""
    h, w, _, t = _logp_problem(64, 300, 1000, torch.float32)
    plain = torch.log_softmax(F.linear(h, w), -1).gather(-1, t[:, None]).squeeze(-1)
    assert not torch.equal(op("linear_logp")(h, w, t), plain)
