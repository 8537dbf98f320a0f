"""linear_logp == log_softmax(lm_head(hidden) / T) gathered at the targets, bit for bit.

That right-hand side is exactly how the rollout engine scores a sampled token,
so this equality is the kernel-level half of trainer == rollout parity. The
equality tests run on both CPU backends (cpp, the default, and native; native
skips with the platform probe's reason where it refuses the dtype).
"""

import importlib

import pytest
import torch

from rl_engine.kernels import get_op
from tests.helpers.invariance import skip_if_refused

BACKENDS = ["cpp", "native"]

linear_logp = get_op("linear_logp", "cpu")


def _problem(n, hidden, vocab, dtype, bias=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, hidden, generator=g).to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) / hidden**0.5).to(dtype)
    b = torch.randn(vocab, generator=g).to(dtype) if bias else None
    t = torch.randint(0, vocab, (n,), generator=g)
    return h, w, b, t


def _chunk_module(backend):
    # the package re-exports the function under the module's name; fetch the module itself
    return importlib.import_module(f"rl_engine.kernels.{backend}.linear_logp")


def _rollout_side(h, w, b, t, temperature, backend="cpp"):
    logits = get_op("lm_head", "cpu", backend=backend)(h, w, b)
    logp = get_op("log_softmax", "cpu", backend=backend)(logits, temperature)
    return logp.gather(-1, t[:, None]).squeeze(-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize(
    "n,hidden,vocab,bias",
    [(1, 64, 1000, False), (37, 96, 1000, True), (300, 576, 4099, False), (70, 1100, 333, False)],
)
@pytest.mark.parametrize("chunk_elements", [1, 5000, 8 * 1024 * 1024])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bitwise_equal_to_materialised_logits(
    monkeypatch, n, hidden, vocab, bias, temperature, dtype, chunk_elements, backend
):
    skip_if_refused(backend, dtype)
    monkeypatch.setattr(_chunk_module(backend), "CHUNK_ELEMENTS", chunk_elements)
    h, w, b, t = _problem(n, hidden, vocab, dtype, bias)
    ours = get_op("linear_logp", "cpu", backend=backend)(h, w, t, b, temperature=temperature)
    assert ours.dtype == torch.float32 and ours.shape == t.shape
    assert torch.equal(ours, _rollout_side(h, w, b, t, temperature, backend))
    # and each token scored alone (a decode step of batch 1) gives the same bits
    assert torch.equal(ours[:1], _rollout_side(h[:1], w, b, t[:1], temperature, backend))


def test_ignore_index_and_leading_dims():
    h, w, _, t = _problem(24, 64, 1000, torch.float32)
    t = t.reshape(4, 6).clone()
    t[0, :2] = -100
    out = linear_logp(h.reshape(4, 6, 64), w, t)
    assert out.shape == (4, 6)
    assert torch.equal(out[0, :2], torch.zeros(2))
    full = linear_logp(h, w, t.reshape(-1).clamp(min=0)).reshape(4, 6)
    assert torch.equal(out[0, 2:], full[0, 2:]) and torch.equal(out[1:], full[1:])
    assert linear_logp(h, w, torch.full((24,), 7), ignore_index=7).abs().sum() == 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-4), (torch.bfloat16, 5e-2)])
def test_backward_matches_reference(monkeypatch, dtype, tol, backend):
    skip_if_refused(backend, dtype)
    monkeypatch.setattr(_chunk_module(backend), "CHUNK_ELEMENTS", 3000)  # the smallest chunks
    linear_logp = get_op("linear_logp", "cpu", backend=backend)
    h, w, b, t = _problem(150, 48, 500, dtype, bias=True)  # 150 rows: several chunks on both
    t[3] = -100
    coeff = torch.randn(150)

    def grads(fn, cast):
        leaves = [x.detach().to(cast).requires_grad_(True) for x in (h, w, b)]
        (fn(*leaves) * coeff).sum().backward()
        return [x.grad.double() for x in leaves]

    def reference(hh, ww, bb):
        logp = torch.log_softmax((hh @ ww.t() + bb) / 0.7, -1)
        picked = logp.gather(-1, t.clamp(min=0)[:, None]).squeeze(-1)
        return torch.where(t == -100, torch.zeros_like(picked), picked)

    ours = grads(lambda hh, ww, bb: linear_logp(hh, ww, t, bb, temperature=0.7), dtype)
    again = grads(lambda hh, ww, bb: linear_logp(hh, ww, t, bb, temperature=0.7), dtype)
    ref = grads(reference, torch.float64)
    for g_ours, g_again, g_ref in zip(ours, again, ref):
        assert torch.equal(g_ours, g_again)
        torch.testing.assert_close(g_ours, g_ref, atol=tol * g_ref.abs().max().item(), rtol=0)
    assert torch.equal(ours[0][3], torch.zeros(48, dtype=torch.float64))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_frozen_head_gets_no_gradient_and_the_same_hidden_gradient(monkeypatch, dtype, backend):
    """A frozen weight (a LoRA policy's vocabulary head) is never given a V x H gradient, and
    the hidden states' gradient is bitwise the trainable head's."""
    skip_if_refused(backend, dtype)
    monkeypatch.setattr(_chunk_module(backend), "CHUNK_ELEMENTS", 3000)
    linear_logp = get_op("linear_logp", "cpu", backend=backend)
    h, w, b, t = _problem(150, 48, 500, dtype, bias=True)
    coeff = torch.randn(150)
    made = []
    real_zeros = torch.zeros

    def counting_zeros(*shape, **kwargs):
        out = real_zeros(*shape, **kwargs)
        made.append(tuple(out.shape))
        return out

    def hidden_grad(train_head: bool):
        hh = h.detach().requires_grad_(True)
        ww, bb = (x.detach().requires_grad_(train_head) for x in (w, b))
        made.clear()
        monkeypatch.setattr(torch, "zeros", counting_zeros)
        (linear_logp(hh, ww, t, bb, temperature=0.7) * coeff).sum().backward()
        monkeypatch.setattr(torch, "zeros", real_zeros)
        return hh.grad, ww.grad, bb.grad, list(made)

    trained, frozen = hidden_grad(True), hidden_grad(False)
    assert torch.equal(trained[0], frozen[0])
    assert trained[1] is not None and trained[2] is not None
    assert frozen[1] is None and frozen[2] is None
    assert tuple(w.shape) in trained[3] and tuple(w.shape) not in frozen[3]


def test_gradcheck_fp64():
    linear_logp = get_op("linear_logp", "cpu", allow_non_invariant=True)  # cpp's fp64: opt in
    h, w, b, t = _problem(6, 8, 11, torch.float64, bias=True)
    leaves = [x.requires_grad_(True) for x in (h, w, b)]
    assert torch.autograd.gradcheck(
        lambda hh, ww, bb: linear_logp(hh, ww, t, bb, temperature=0.5), leaves
    )


def test_empty_batch_keeps_autograd():
    _, w, _, _ = _problem(1, 64, 1000, torch.float32)
    h = torch.zeros(0, 64, requires_grad=True)
    out = linear_logp(h, w, torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)
    out.sum().backward()
    assert h.grad.shape == (0, 64)


def test_bad_inputs_name_the_problem():
    h, w, _, t = _problem(5, 64, 1000, torch.float32)
    with pytest.raises(
        ValueError,
        match=r"targets out of range: min \d+, max 1000, but the vocabulary size is 1000",
    ):
        linear_logp(h, w, torch.tensor([1, 2, 3, 4, 1000]))
    with pytest.raises(
        ValueError, match=r"targets shape \(4,\) must equal hidden's leading shape \(5,\)"
    ):
        linear_logp(h, w, t[:4])
    with pytest.raises(TypeError, match="hidden must be a floating-point tensor"):
        linear_logp(h.long(), w, t)
    with pytest.raises(ValueError, match="hidden has last dim 63"):
        linear_logp(h[:, :63], w, t)
    with pytest.raises(ValueError, match="temperature must be a finite number > 0"):
        linear_logp(h, w, t, temperature=0.0)
    with pytest.raises(TypeError, match="targets must be an integer tensor"):
        linear_logp(h, w, t.float())


def _one_accumulator(parts, shape, dtype):
    """The weight gradient as one full-size fp32 accumulator gives it: the memory-hungry
    formula `WeightGradient` must reproduce bit for bit."""
    total = torch.zeros(shape, dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    for g, h in parts:
        total += g.t() @ h
    return total.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows_per_chunk,chunks", [(3, 4), (40, 3)])  # kept chunks; accumulator
@pytest.mark.parametrize("block_rows", [64, 100, 16384])
def test_weight_gradient_bitwise_equal_to_one_accumulator(
    monkeypatch, dtype, rows_per_chunk, chunks, block_rows
):
    from rl_engine.kernels.common import linear_logp as common

    monkeypatch.setattr(common, "GRAD_BLOCK_ROWS", block_rows)
    vocab, hidden = 300, 16  # 3 x 4 rows of g fit a 300 x 16 fp32 accumulator, 40 x 3 do not
    gen = torch.Generator().manual_seed(1)
    parts = [
        (
            torch.randn(rows_per_chunk, vocab, generator=gen).to(dtype),
            torch.randn(rows_per_chunk, hidden, generator=gen).to(dtype),
        )
        for _ in range(chunks)
    ]
    weight = torch.empty(vocab, hidden, dtype=dtype)
    gradient = common.WeightGradient(weight, rows_per_chunk * chunks)
    assert (gradient.blocks is None) == (rows_per_chunk == 3)
    for g, h in parts:
        gradient.add(g, h)
    got = gradient.result()
    assert got.dtype == dtype and got.shape == (vocab, hidden)
    assert torch.equal(got, _one_accumulator(parts, (vocab, hidden), dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_backward_weight_gradient_same_bits_kept_or_accumulated(monkeypatch, dtype):
    from rl_engine.kernels.common import linear_logp as common

    monkeypatch.setattr(_chunk_module("cpp"), "CHUNK_ELEMENTS", 3000)  # several chunks
    monkeypatch.setattr(common, "GRAD_BLOCK_ROWS", 128)
    linear_logp = get_op("linear_logp", "cpu", backend="cpp")
    h, w, b, t = _problem(150, 48, 500, dtype, bias=True)

    def weight_grad():
        ww = w.detach().clone().requires_grad_(True)
        linear_logp(h, ww, t, b, temperature=0.7).sum().backward()
        return ww.grad

    kept = weight_grad()  # 150 x 500 rows of g fit a 500 x 48 fp32 accumulator: kept
    real_init = common.WeightGradient.__init__

    def accumulate(self, weight, rows):
        real_init(self, weight, rows)
        self.parts, self.blocks = [], [self._zeros(b - a) for a, b in common._row_blocks(500)]

    monkeypatch.setattr(common.WeightGradient, "__init__", accumulate)
    assert torch.equal(kept, weight_grad())
