"""moe_experts on CPU (cpp and native): a token's bits never depend on the batch.

Chains checked, always with torch.equal: a token's output alone == its row in batches whose
other tokens share its experts, are garbage or permuted; and == Hugging Face's eager experts
loop (`index_add_` in ascending expert order, the model dtype) run with the same invariant
linear and silu: the combine order and roundings are HF's; cpp's one-call experts == the
shared `composed_forward` of cpp's linear and silu; router and experts outputs for 1/2/3
threads. The shared pieces (common/moe_experts.py): `group_by_expert` groups each expert's
(token, slot) rows in token order, `combine` adds a token's slots in slot order.
Negative control: HF's default `grouped_mm` raises for odd bf16 expert widths. Accuracy
against HF (tolerance), gradcheck in fp64, deterministic backward passes, empty batches and
errors naming the bad input. The router's own tests: test_moe_router.py.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.common.moe_experts import combine, composed_forward, group_by_expert
from tests.helpers.invariance import assert_equal_across_threads, garbage_like, skip_if_refused
from tests.helpers.kernels.moe import (
    EXPERTS,
    HIDDEN,
    TOP_K,
    experts_weights,
    hf_eager_experts,
    randn,
    skip_native_where_refused,
)

BACKENDS = ["cpp", "native"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _native_serves_the_dtype(request):
    skip_native_where_refused(request)


def _routing(tokens, dtype, seed, experts=EXPERTS):
    hidden = randn(tokens, HIDDEN, dtype=dtype, seed=seed)
    weight = randn(experts, HIDDEN, dtype=dtype, seed=seed + 1)
    _, weights, indices = get_op("moe_router", "cpu")(hidden, weight, TOP_K, renormalize=True)
    return hidden, indices, weights


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_token_is_batch_invariant(backend, dtype):
    experts = get_op("moe_experts", "cpu", backend=backend)
    gate_up, down = experts_weights(dtype)
    hidden, indices, weights = _routing(300, dtype, seed=14)
    probe = 7
    alone = experts(
        hidden[probe : probe + 1],
        gate_up,
        down,
        indices[probe : probe + 1],
        weights[probe : probe + 1],
    )
    for size in (1, 2, 5, 33, 300):
        g = torch.Generator().manual_seed(size)
        rows = torch.randint(0, 300, (size,), generator=g)
        row = int(torch.randint(0, size, (1,), generator=g))
        rows[row] = probe
        got = experts(hidden[rows], gate_up, down, indices[rows], weights[rows])
        assert torch.equal(got[row], alone[0]), f"batch of {size}, row {row}"
        noisy = garbage_like(hidden[rows])
        noisy[row] = hidden[probe]
        got = experts(noisy, gate_up, down, indices[rows], weights[rows])
        assert torch.equal(got[row], alone[0]), "garbage tokens changed the probe"
    # every other token routed to the probe's experts (the most rows those experts ever get)
    same = indices[probe].expand(300, -1).contiguous()
    got = experts(hidden, gate_up, down, same, weights)
    single = experts(hidden[probe : probe + 1], gate_up, down, same[:1], weights[probe : probe + 1])
    assert torch.equal(got[probe], single[0])


@pytest.mark.parametrize("weights_dtype", [None, torch.float32], ids=["model", "fp32"])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_equal_hf_eager_loop_with_the_same_linear_and_silu(backend, dtype, weights_dtype):
    """Same projections and activation -> same bits: the combine order and roundings are HF's."""
    experts = get_op("moe_experts", "cpu", backend=backend)
    linear, silu = get_op("linear", "cpu", backend=backend), get_op("silu", "cpu", backend=backend)
    gate_up, down = experts_weights(dtype)
    hidden, indices, weights = _routing(97, dtype, seed=15)
    if weights_dtype is not None:  # Mixtral: bf16 expert outputs times fp32 weights
        weights = weights.float() + 1e-3
    got = experts(hidden, gate_up, down, indices, weights)
    ref = hf_eager_experts(hidden, gate_up, down, indices, weights, linear, silu)
    assert got.dtype == dtype
    assert torch.equal(got, ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_cpp_fused_experts_equal_the_composition_of_cpp_linear_and_silu(dtype):
    """The one-call C++ experts (csrc/moe_impl.h) == the per-expert composition, at shapes with
    K blocks (hidden 600, width 300) and experts receiving more rows than a decode task."""
    cpp = get_op("moe_experts", "cpu", backend="cpp")
    composed = composed_forward(get_op("linear", "cpu"), get_op("silu", "cpu"))
    g = torch.Generator().manual_seed(24)
    hidden = torch.randn(200, 600, generator=g).to(dtype)
    gate_up = (torch.randn(3, 600, 600, generator=g) / 25).to(dtype)
    down = (torch.randn(3, 600, 300, generator=g) / 17).to(dtype)
    indices = torch.stack([torch.randperm(3, generator=g)[:2] for _ in range(200)])
    weights = torch.rand(200, 2, generator=g).to(dtype)
    assert torch.equal(
        cpp(hidden, gate_up, down, indices, weights),
        composed(hidden, gate_up, down, indices, weights, False)[0],
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_experts_accuracy_against_hf_and_odd_bf16_widths(dtype):
    experts = get_op("moe_experts", "cpu")
    for width in (44, 36, 7):  # grouped_mm raises on CPU for 16-bit widths not a multiple of 8
        gate_up, down = experts_weights(dtype, width=width)
        hidden, indices, weights = _routing(50, dtype, seed=16)
        ref = hf_eager_experts(
            hidden.double(), gate_up.double(), down.double(), indices, weights.double()
        )
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(
            experts(hidden, gate_up, down, indices, weights).double(), ref, atol=tol, rtol=tol
        )


def test_platform_assumption_grouped_mm_raises_for_odd_bf16_widths():
    x = torch.randn(6, 40).bfloat16()
    w = torch.randn(2, 40, 44).bfloat16()
    offs = torch.tensor([3, 6], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="multiple of 16 bytes"):
        torch._grouped_mm(x, w, offs=offs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_gradcheck_fp64(backend):
    skip_if_refused(backend, torch.float64)
    experts = get_op("moe_experts", "cpu", backend=backend, allow_non_invariant=True)  # as above
    gate_up, down = (t.double().requires_grad_() for t in experts_weights(torch.float32, 4, 6, 3))
    hidden = randn(5, 6, dtype=torch.float64, seed=17).requires_grad_()
    indices = torch.tensor([[0, 2], [2, 1], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(5, 2, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, gu, d, w: experts(h, gu, d, indices, w), (hidden, gate_up, down, weights)
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_experts_backward_matches_autograd_of_hf_loop_and_is_deterministic(dtype, tol):
    experts = get_op("moe_experts", "cpu")
    gate_up, down = experts_weights(dtype)
    hidden, indices, weights = _routing(40, dtype, seed=18)
    grad_out = randn(40, HIDDEN, dtype=dtype, seed=19)

    def grads(fn):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, gate_up, down, weights)]
        fn(leaves[0], leaves[1], leaves[2], indices, leaves[3]).backward(grad_out)
        return [t.grad for t in leaves]

    first, second = grads(experts), grads(experts)
    assert all(torch.equal(a, b) for a, b in zip(first, second)), "backward is not deterministic"
    for got, ref in zip(first, grads(hf_eager_experts)):
        torch.testing.assert_close(got.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch_and_bad_inputs(backend):
    experts = get_op("moe_experts", "cpu", backend=backend)
    router = get_op("moe_router", "cpu", backend=backend)
    gate_up, down = experts_weights(torch.float32)
    weight = randn(EXPERTS, HIDDEN, seed=20)
    hidden = torch.zeros(0, HIDDEN, requires_grad=True)
    logits, weights, indices = router(hidden, weight, TOP_K)
    out = experts(hidden, gate_up, down, indices, weights)
    assert out.shape == (0, HIDDEN)
    (out.sum() + logits.sum()).backward()  # autograd stays connected
    x = randn(4, HIDDEN)
    idx = torch.zeros(4, 2, dtype=torch.long)
    w = torch.ones(4, 2)
    with pytest.raises(
        ValueError,
        match=r"expert indices out of range: min 10, max 10, but the number of experts is 10",
    ):
        experts(x, gate_up, down, idx + 10, w)
    with pytest.raises(ValueError, match="down must be"):
        experts(x, gate_up, down[:, :, :-1], idx, w)
    with pytest.raises(ValueError, match="routing weights shape"):
        experts(x, gate_up, down, idx, w[:, :1])
    with pytest.raises(TypeError, match="hidden is torch.bfloat16 but gate_up is torch.float32"):
        experts(x.bfloat16(), gate_up, down, idx, w)
    with pytest.raises(ValueError, match=r"top_k must be an int in \[1, num_experts=10\]"):
        router(x, weight, 11)
    with pytest.raises(ValueError, match="router weight's hidden size"):
        router(x[:, :-1], weight, 2)


def test_group_by_expert_orders_rows_by_expert_then_token():
    indices = torch.tensor([[2, 0], [0, 1], [2, 1]])  # 3 tokens, top 2 of 4 experts
    grouping = group_by_expert(indices, 4)
    # pairs j * N + t (slot-major): 0 (t0, e2), 1 (t1, e0), 2 (t2, e2), 3 (t0, e0), 4 (t1, e1),
    # 5 (t2, e1); by expert, then pair: e0 [1, 3], e1 [4, 5], e2 [0, 2]; expert 3 has none
    assert grouping.order.tolist() == [1, 3, 4, 5, 0, 2]
    assert grouping.tokens.tolist() == [1, 0, 1, 2, 0, 2]
    assert grouping.spans == ((0, 0, 2), (1, 2, 4), (2, 4, 6))
    # each token's grouped rows, its lowest expert first: t0 (e0, e2), t1 (e0, e1), t2 (e1, e2)
    assert grouping.combine_rows.tolist() == [[1, 4], [0, 2], [3, 5]]


def test_combine_adds_a_tokens_rows_from_zero_in_the_given_order():
    g = torch.Generator().manual_seed(25)
    rows = torch.randn(6, 5, generator=g) * torch.tensor([1e8, 1.0, 1e-8, 3.0, 1e4])
    combine_rows = torch.tensor([[1, 4], [0, 2], [3, 5]])
    expected = torch.stack([(torch.zeros(5) + rows[a]) + rows[b] for a, b in combine_rows.tolist()])
    assert torch.equal(combine(rows, combine_rows), expected)
    assert combine(rows, torch.zeros(0, 2, dtype=torch.long)).shape == (0, 5)


THREADS_CODE = """
import torch
from rl_engine.kernels import get_op
from tests.helpers.kernels.moe import experts_weights, randn
result = {}
for backend in ("cpp", "native"):
    for dtype in (torch.float32, torch.bfloat16):
        hidden = randn(300, 72, dtype=dtype, seed=21)
        weight = randn(10, 72, dtype=dtype, seed=22)
        gate_up, down = experts_weights(dtype, hidden=72)
        logits, w, idx = get_op("moe_router", "cpu", backend)(hidden, weight, 3, renormalize=True)
        out = get_op("moe_experts", "cpu", backend)(hidden, gate_up, down, idx, w)
        for name, t in (("logits", logits), ("weights", w), ("indices", idx), ("out", out)):
            result[f"{backend} {dtype} {name}"] = t
"""


@pytest.mark.multiprocess
@pytest.mark.threads
def test_thread_count_invariance():
    assert_equal_across_threads(THREADS_CODE, threads=(1, 2, 3))
