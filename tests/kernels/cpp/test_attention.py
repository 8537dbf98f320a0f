"""The cpp attention (cpp/attention.py): one query row at a time through the fixed-order kernel.

Chain: a decode query at position p (Tq = 1) == row p of the full causal prefill, torch.equal,
fp32 and bf16, grouped-query heads; keys past p (even nan) never reach row p; fp64 is the
native op's forward, bit for bit, and refused (PlatformInvarianceError) where native's
platform probe refuses it, as native refuses it; fp32 / bf16 never ask the probe. Accuracy (forward and SDPA's backward) against fp64
SDPA. Negative controls: SDPA's decode row differs from its prefill row somewhere, and a
key at a position <= p does change row p. Prefill at an offset and packed rows, every
backend: tests/kernels/test_prefill_at_offset.py and tests/kernels/common/test_attention.py.
"""

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import PlatformInvarianceError, get_op
from rl_engine.kernels.cpp.attention import attention
from rl_engine.kernels.native.platform_probe import platform_refusal

B, HQ, HKV, T, D = 2, 4, 2, 40, 16


def _qkv(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, HQ, T, D, generator=g).to(dtype)
    k, v = (torch.randn(B, HKV, T, D, generator=g).to(dtype) for _ in range(2))
    return q, k, v


def _positions(t=T):
    return torch.arange(t).expand(B, t)


def _sdpa(q, k, v, causal=True):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_query_has_the_bits_of_its_prefill_row(dtype):
    q, k, v = _qkv(dtype)
    full = attention(q, k, v, q_positions=_positions())
    assert full.dtype == dtype and full.shape == q.shape
    for p in (0, 1, 17, T - 1):
        decode = attention(q[:, :, p : p + 1], k, v, q_positions=torch.full((B, 1), p))
        assert torch.equal(decode[:, :, 0], full[:, :, p]), p


def test_negative_control_sdpa_decode_rows_differ_from_its_prefill_rows():
    q, k, v = _qkv(torch.float32)
    full = _sdpa(q, k, v)
    same = [
        torch.equal(
            _sdpa(q[:, :, p : p + 1], k[:, :, : p + 1], v[:, :, : p + 1], False)[:, :, 0],
            full[:, :, p],
        )
        for p in range(T)
    ]
    assert not all(same)


def test_keys_past_the_query_never_reach_it_and_earlier_keys_do():
    q, k, v = _qkv(torch.float32)
    p = 20
    want = attention(q[:, :, p : p + 1], k, v, q_positions=torch.full((B, 1), p))
    k2, v2 = k.clone(), v.clone()
    k2[:, :, p + 1 :], v2[:, :, p + 1 :] = float("nan"), float("inf")
    assert torch.equal(
        attention(q[:, :, p : p + 1], k2, v2, q_positions=torch.full((B, 1), p)), want
    )
    k2[:, :, p] += 1  # negative control: the query's own key is read
    assert not torch.equal(
        attention(q[:, :, p : p + 1], k2, v2, q_positions=torch.full((B, 1), p)), want
    )


def test_forward_and_backward_are_accurate_against_float64_sdpa():
    q, k, v = (t.requires_grad_() for t in _qkv(torch.float32))
    out = attention(q, k, v, q_positions=_positions())
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = _sdpa(q64, k64, v64)
    assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    out.backward(grad)
    want.backward(grad.double())
    for got, ref in ((q.grad, q64.grad), (k.grad, k64.grad), (v.grad, v64.grad)):
        assert torch.allclose(got.double(), ref, rtol=1e-4, atol=1e-5)


def test_fp64_is_the_native_forward():
    """The opt-in ops: their bits, on every machine (the strict ones: the next test)."""
    q, k, v = _qkv(torch.float64)
    cpp = get_op("attention", "cpu", backend="cpp", allow_non_invariant=True)
    native = get_op("attention", "cpu", backend="native", allow_non_invariant=True)
    assert torch.equal(
        cpp(q, k, v, q_positions=_positions()), native(q, k, v, q_positions=_positions())
    )


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.float32, torch.bfloat16])
def test_native_forward_dtypes_refuse_where_natives_probe_refuses(dtype):
    """fp64 / fp16 run native's forward (fixed-shape library GEMMs): where native's probe
    refuses the dtype here, cpp refuses it by name too, never a silent non-invariant result.
    fp32 / bf16 are the C++ kernel's, served whatever the probe says."""
    q, k, v = _qkv(dtype)
    reason = None if dtype in (torch.float32, torch.bfloat16) else platform_refusal(dtype, "cpu")
    if reason is None:
        assert attention(q, k, v, q_positions=_positions()).dtype == dtype
        return
    with pytest.raises(PlatformInvarianceError) as err:
        attention(q, k, v, q_positions=_positions())
    message = str(err.value)
    for named in ("'attention'", "'cpp'", str(dtype).removeprefix("torch."), reason):
        assert named in message, message


def test_bad_inputs_are_named():
    q, k, v = _qkv(torch.float32)
    twice = torch.zeros(B, T, dtype=torch.long)
    with pytest.raises(ValueError, match="q_positions: a sequence has the same position twice"):
        attention(q, k, v, q_positions=twice)
    with pytest.raises(ValueError, match="needs that many keys plus one, but k holds 10"):
        attention(q, k[:, :, :10], v[:, :, :10], q_positions=_positions())
    wide = torch.zeros(1, 1, 1, 272)
    with pytest.raises(ValueError, match="head dim 272; the cpp backend supports up to 256"):
        attention(wide, wide, wide, q_positions=torch.zeros(1, 1, dtype=torch.long))
