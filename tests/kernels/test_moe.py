"""moe_router, moe_experts and sigmoid on CPU (cpp and native): a token's bits never depend on the batch.

Chains checked, always with torch.equal:
- router: logits, weights and expert ids of a token alone == its row in batches
  of 1..4096 tokens, at any row, next to garbage, and for 1/2/3 threads;
  equal probabilities go to the lowest expert index in every batch (a router
  with two identical expert rows, and one where all experts tie);
- experts: a token's output alone == its row in batches whose other tokens
  share its experts, are garbage or permuted; and == Hugging Face's eager
  experts loop (`index_add_` in ascending expert order, the model dtype) run
  with the same invariant linear and silu: the combine order and roundings are
  HF's.
Negative controls: `torch.topk` orders tied experts differently from row to
row, HF's router logits (`F.linear`) change with the batch, HF's default
`grouped_mm` raises for odd bf16 expert widths, `torch.sigmoid` is not
position-invariant. Accuracy against HF (tolerance), gradcheck in fp64, and
deterministic backward passes.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import get_op
from tests.helpers.invariance import (
    assert_equal_across_threads,
    garbage_like,
    probe_batches,
    skip_if_refused,
)
from tests.helpers.kernels.moe import hf_eager_experts

BACKENDS = ["cpp", "native"]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _native_serves_the_dtype(request):
    """A native case runs only where the platform probe accepts its dtype (fp32 by default):
    native refuses a dtype whose library GEMM is not row-invariant on this CPU (fail closed)."""
    params = getattr(request.node, "callspec", None)
    params = params.params if params else {}
    if params.get("backend") == "native":
        skip_if_refused("native", params.get("dtype", torch.float32))


BATCH_SIZES = [1, 2, 3, 8, 33, 128, 1000, 4096]
HIDDEN, EXPERTS, TOP_K, WIDTH = 72, 10, 3, 22


def _randn(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _experts_weights(dtype, experts=EXPERTS, hidden=HIDDEN, width=WIDTH, seed=1):
    gate_up = _randn(experts, 2 * width, hidden, dtype=dtype, seed=seed, scale=hidden**-0.5)
    down = _randn(experts, hidden, width, dtype=dtype, seed=seed + 1, scale=width**-0.5)
    return gate_up, down


# ----------------------------------------------------------------------------- router


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_router_rows_are_batch_invariant(backend, dtype, renormalize):
    router = get_op("moe_router", "cpu", backend=backend)
    weight = _randn(EXPERTS, HIDDEN, dtype=dtype, seed=3)
    pool = _randn(256, HIDDEN, dtype=dtype, seed=4)
    probe = pool[5]
    alone = router(probe[None], weight, TOP_K, renormalize=renormalize)
    for batch, row in probe_batches(probe, pool, BATCH_SIZES):
        for layout in (batch, _with_garbage(batch, row)):
            out = router(layout, weight, TOP_K, renormalize=renormalize)
            for got, ref in zip(out, alone):
                assert torch.equal(got[row], ref[0]), f"batch of {batch.shape[0]}, row {row}"


def _with_garbage(batch, row):
    noisy = garbage_like(batch)
    noisy[row] = batch[row]
    return noisy


@pytest.mark.parametrize("backend", BACKENDS)
def test_router_output_types_and_hf_conventions(backend):
    router = get_op("moe_router", "cpu", backend=backend)
    hidden = _randn(2, 3, HIDDEN, dtype=torch.bfloat16)
    weight = _randn(EXPERTS, HIDDEN, dtype=torch.bfloat16, seed=2)
    logits, weights, indices = router(hidden, weight, TOP_K)  # leading dims are tokens
    assert logits.shape == (6, EXPERTS) and logits.dtype == torch.bfloat16
    assert weights.shape == (6, TOP_K) and weights.dtype == torch.bfloat16  # cast back
    assert indices.dtype == torch.long
    _, kept, _ = router(hidden, weight, TOP_K, renormalize=True, weights_dtype=torch.float32)
    assert kept.dtype == torch.float32  # Mixtral keeps the weights in fp32
    assert torch.allclose(kept.sum(-1), torch.ones(6))
    # descending probabilities, k distinct experts
    probs = torch.softmax(logits.float(), -1).gather(1, indices)
    assert bool((probs[:, :-1] >= probs[:, 1:]).all())
    assert all(len(set(row)) == TOP_K for row in indices.tolist())


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_router_ties_go_to_the_lowest_expert_in_every_batch(backend, dtype):
    router = get_op("moe_router", "cpu", backend=backend)
    weight = _randn(EXPERTS, HIDDEN, dtype=dtype, seed=5)
    weight[7] = weight[2]  # every token meets an exact tie between experts 2 and 7
    pool = _randn(300, HIDDEN, dtype=dtype, seed=6)
    logits, _, indices = router(pool, weight, EXPERTS)
    pos = {e: (indices == e).nonzero()[:, 1] for e in (2, 7)}
    assert bool((pos[2] < pos[7]).all()), "of the twins, expert 2 must come first"
    probs = torch.softmax(logits.float(), -1).gather(1, indices)  # descending
    tied = probs[:, :-1] == probs[:, 1:]
    assert bool((indices[:, :-1] < indices[:, 1:])[tied].all()), "every tie ascends in index"
    alone = torch.stack([router(pool[i : i + 1], weight, 4)[2][0] for i in range(0, 300, 37)])
    assert torch.equal(router(pool, weight, 4)[2][::37], alone)
    # all experts tie: the first k experts, equal weights, in any batch
    flat = torch.zeros_like(weight)
    for rows in (1, 5, 300):
        _, w, idx = router(pool[:rows], flat, TOP_K, renormalize=True)
        assert torch.equal(idx, torch.arange(TOP_K).expand(rows, -1))
        assert bool((w == w[0, 0]).all())


def test_negative_control_topk_orders_ties_arbitrarily_and_hf_logits_follow_the_batch():
    probs = torch.softmax(_randn(1000, 64, seed=7), -1)
    probs[:, 50] = probs[:, 10] = 1.0  # an exact tie at the top of every row
    _, idx = torch.topk(probs, 2)
    assert {tuple(r) for r in idx.tolist()} == {(10, 50), (50, 10)}, "topk has no tie rule"
    weight = _randn(64, 1024, seed=8)
    pool = _randn(300, 1024, seed=9)
    alone = torch.cat([F.linear(pool[i : i + 1], weight) for i in range(300)])
    assert not torch.equal(alone, F.linear(pool, weight)), "plain router logits follow the batch"


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_router_matches_the_hf_router(family):
    from transformers import MixtralConfig, Qwen3MoeConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    sizes = {"hidden_size": HIDDEN, "num_experts_per_tok": TOP_K}
    if family == "mixtral":
        hf = MixtralTopKRouter(MixtralConfig(num_local_experts=EXPERTS, **sizes))
        options = {"renormalize": True, "weights_dtype": torch.float32}
    else:
        hf = Qwen3MoeTopKRouter(Qwen3MoeConfig(num_experts=EXPERTS, norm_topk_prob=True, **sizes))
        options = {"renormalize": True}
    with torch.no_grad():
        hf.weight.copy_(_randn(EXPERTS, HIDDEN, seed=10))
    hidden = _randn(64, HIDDEN, seed=11)
    ref_logits, ref_weights, ref_indices = hf(hidden)
    logits, weights, indices = get_op("moe_router", "cpu")(hidden, hf.weight, TOP_K, **options)
    assert torch.equal(indices, ref_indices)  # random logits: no ties
    assert weights.dtype == ref_weights.dtype
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(weights, ref_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("backend", BACKENDS)
def test_router_gradcheck_fp64(backend, renormalize):
    skip_if_refused(backend, torch.float64)
    # fp64 is not row-invariant on cpp (a torch GEMM): gradcheck opts in to it
    router = get_op("moe_router", "cpu", backend=backend, allow_non_invariant=True)
    hidden = _randn(5, 7, dtype=torch.float64, seed=12).requires_grad_()
    weight = _randn(6, 7, dtype=torch.float64, seed=13).requires_grad_()

    def routed(h, w):
        logits, weights, _ = router(h, w, 3, renormalize=renormalize)
        return logits, weights

    assert torch.autograd.gradcheck(routed, (hidden, weight))


# ----------------------------------------------------------------------------- experts


def _routing(tokens, dtype, seed, experts=EXPERTS):
    hidden = _randn(tokens, HIDDEN, dtype=dtype, seed=seed)
    weight = _randn(experts, HIDDEN, dtype=dtype, seed=seed + 1)
    _, weights, indices = get_op("moe_router", "cpu")(hidden, weight, TOP_K, renormalize=True)
    return hidden, indices, weights


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_experts_token_is_batch_invariant(backend, dtype):
    experts = get_op("moe_experts", "cpu", backend=backend)
    gate_up, down = _experts_weights(dtype)
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
    gate_up, down = _experts_weights(dtype)
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
    from rl_engine.kernels.common.moe_experts import composed_forward

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
        gate_up, down = _experts_weights(dtype, width=width)
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
    gate_up, down = (t.double().requires_grad_() for t in _experts_weights(torch.float32, 4, 6, 3))
    hidden = _randn(5, 6, dtype=torch.float64, seed=17).requires_grad_()
    indices = torch.tensor([[0, 2], [2, 1], [3, 0], [0, 2], [1, 3]])
    weights = torch.rand(5, 2, dtype=torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda h, gu, d, w: experts(h, gu, d, indices, w), (hidden, gate_up, down, weights)
    )


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 5e-2)])
def test_experts_backward_matches_autograd_of_hf_loop_and_is_deterministic(dtype, tol):
    experts = get_op("moe_experts", "cpu")
    gate_up, down = _experts_weights(dtype)
    hidden, indices, weights = _routing(40, dtype, seed=18)
    grad_out = _randn(40, HIDDEN, dtype=dtype, seed=19)

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
    gate_up, down = _experts_weights(torch.float32)
    weight = _randn(EXPERTS, HIDDEN, seed=20)
    hidden = torch.zeros(0, HIDDEN, requires_grad=True)
    logits, weights, indices = router(hidden, weight, TOP_K)
    out = experts(hidden, gate_up, down, indices, weights)
    assert out.shape == (0, HIDDEN)
    (out.sum() + logits.sum()).backward()  # autograd stays connected
    x = _randn(4, HIDDEN)
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


THREADS_CODE = """
import torch
from rl_engine.kernels import get_op
from tests.kernels.test_moe import _experts_weights, _randn
result = {}
for backend in ("cpp", "native"):
    for dtype in (torch.float32, torch.bfloat16):
        hidden = _randn(300, 72, dtype=dtype, seed=21)
        weight = _randn(10, 72, dtype=dtype, seed=22)
        gate_up, down = _experts_weights(dtype, hidden=72)
        logits, w, idx = get_op("moe_router", "cpu", backend)(hidden, weight, 3, renormalize=True)
        out = get_op("moe_experts", "cpu", backend)(hidden, gate_up, down, idx, w)
        for name, t in (("logits", logits), ("weights", w), ("indices", idx), ("out", out)):
            result[f"{backend} {dtype} {name}"] = t
"""


@pytest.mark.multiprocess
@pytest.mark.threads
def test_thread_count_invariance():
    assert_equal_across_threads(THREADS_CODE, threads=(1, 2, 3))


# ----------------------------------------------------------------------------- sigmoid


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_sigmoid_is_position_invariant_and_torch_sigmoid_is_not(dtype):
    sigmoid = get_op("sigmoid", "cpu")
    x = _randn(4099, dtype=dtype, seed=23, scale=4.0)
    full = sigmoid(x)
    alone = torch.cat([sigmoid(x[i : i + 1]) for i in range(300)])
    assert torch.equal(full[:300], alone)
    shifted = torch.cat([sigmoid(x[i : i + 13]) for i in range(0, 299, 13)])
    assert torch.equal(full[: shifted.numel()], shifted)
    torch.testing.assert_close(full.double(), torch.sigmoid(x.double()), atol=1e-2, rtol=1e-2)
    if dtype == torch.float32:  # the negative control (bf16 rounds the difference away)
        plain = torch.cat([torch.sigmoid(x[i : i + 1]) for i in range(2000)])
        assert not torch.equal(torch.sigmoid(x)[:2000], plain)
