"""moe_router on CPU (cpp and native): a token's routing never depends on the batch.

Chains checked, always with torch.equal: logits, weights and expert ids of a token alone == its
row in batches of 1..4096 tokens, at any row, next to garbage (1/2/3 threads:
test_moe_experts.py::test_thread_count_invariance); equal probabilities go to the lowest expert
index in every batch (a router with two identical expert rows, and one where all experts tie);
the shared pieces (common/moe_router.py): `select_top_k` breaks ties by ascending index,
`fixed_order_sum` adds the slots ((v0 + v1) + v2). Negative controls: `torch.topk` orders tied
experts differently from row to row, HF's router logits (`F.linear`) change with the batch,
another summation order gives other bits. Matches HF's Qwen3-MoE and Mixtral routers
(indices exactly, logits and weights within tolerance); gradcheck in fp64; `check_router`
names the bad argument.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import get_op
from rl_engine.kernels.common.moe_router import check_router, fixed_order_sum, select_top_k
from tests.helpers.invariance import garbage_like, probe_batches, skip_if_refused
from tests.helpers.kernels.moe import EXPERTS, HIDDEN, TOP_K, randn, skip_native_where_refused

BACKENDS = ["cpp", "native"]
DTYPES = [torch.float32, torch.bfloat16]
BATCH_SIZES = [1, 2, 3, 8, 33, 128, 1000, 4096]


@pytest.fixture(autouse=True)
def _native_serves_the_dtype(request):
    skip_native_where_refused(request)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_router_rows_are_batch_invariant(backend, dtype, renormalize):
    router = get_op("moe_router", "cpu", backend=backend)
    weight = randn(EXPERTS, HIDDEN, dtype=dtype, seed=3)
    pool = randn(256, HIDDEN, dtype=dtype, seed=4)
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
    hidden = randn(2, 3, HIDDEN, dtype=torch.bfloat16)
    weight = randn(EXPERTS, HIDDEN, dtype=torch.bfloat16, seed=2)
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
    weight = randn(EXPERTS, HIDDEN, dtype=dtype, seed=5)
    weight[7] = weight[2]  # every token meets an exact tie between experts 2 and 7
    pool = randn(300, HIDDEN, dtype=dtype, seed=6)
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
    probs = torch.softmax(randn(1000, 64, seed=7), -1)
    probs[:, 50] = probs[:, 10] = 1.0  # an exact tie at the top of every row
    _, idx = torch.topk(probs, 2)
    assert {tuple(r) for r in idx.tolist()} == {(10, 50), (50, 10)}, "topk has no tie rule"
    weight = randn(64, 1024, seed=8)
    pool = randn(300, 1024, seed=9)
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
        hf.weight.copy_(randn(EXPERTS, HIDDEN, seed=10))
    hidden = randn(64, HIDDEN, seed=11)
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
    hidden = randn(5, 7, dtype=torch.float64, seed=12).requires_grad_()
    weight = randn(6, 7, dtype=torch.float64, seed=13).requires_grad_()

    def routed(h, w):
        logits, weights, _ = router(h, w, 3, renormalize=renormalize)
        return logits, weights

    assert torch.autograd.gradcheck(routed, (hidden, weight))


def test_select_top_k_is_a_stable_descending_sort():
    probs = torch.tensor([[0.1, 0.3, 0.2, 0.3, 0.1], [0.2, 0.2, 0.2, 0.2, 0.2]])
    values, indices = select_top_k(probs, 3)
    assert indices.tolist() == [[1, 3, 2], [0, 1, 2]]  # ties: the lower expert first
    assert torch.equal(values, probs.gather(1, indices))
    assert values.is_contiguous() and indices.is_contiguous()


def test_fixed_order_sum_adds_the_slots_left_to_right():
    values = torch.softmax(randn(2000, 3, seed=26, scale=4.0), -1)
    total = fixed_order_sum(values)
    assert total.shape == (2000, 1)
    assert torch.equal(total[:, 0], (values[:, 0] + values[:, 1]) + values[:, 2])
    # negative control: the other order rounds differently on some rows
    assert not torch.equal(total[:, 0], (values[:, 2] + values[:, 1]) + values[:, 0])


def test_check_router_names_the_bad_argument():
    hidden, weight = randn(4, HIDDEN), randn(EXPERTS, HIDDEN, seed=1)
    check_router(hidden, weight, EXPERTS)
    with pytest.raises(
        ValueError, match=r"top_k must be an int in \[1, num_experts=10\], got True"
    ):
        check_router(hidden, weight, True)
    with pytest.raises(ValueError, match="got 0"):
        check_router(hidden, weight, 0)
    with pytest.raises(ValueError, match=r"router weight must be 2-D .* got shape \(72,\)"):
        check_router(hidden, weight[0], 1)
    with pytest.raises(
        TypeError, match="hidden is torch.bfloat16 but router weight is torch.float32"
    ):
        check_router(hidden.bfloat16(), weight, 1)
    with pytest.raises(TypeError, match="router weight must be a floating-point tensor"):
        check_router(hidden, weight.long(), 1)
