"""The router terms: HF's load-balancing loss on the invariant routing, and expert-load statistics."""

import math

import pytest
import torch

from rl_engine.algorithms import expert_counts, load_balancing_loss, load_statistics

E, K = 6, 2


def _layers(n=3, tokens=20, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = [torch.randn(tokens, E, generator=g) * 2 for _ in range(n)]
    indices = [torch.topk(torch.softmax(x, -1), K).indices for x in logits]  # no ties here
    return logits, indices


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
@pytest.mark.parametrize("masked", [False, True])
def test_equals_hf_load_balancing_loss_of_every_moe_family(family, masked):
    import importlib

    hf = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    logits, indices = _layers()
    mask = (torch.arange(20) % 7 != 3).long().view(4, 5) if masked else None
    ref = hf.load_balancing_loss_func(tuple(logits), E, K, mask)
    got = load_balancing_loss(logits, indices, E, None if mask is None else mask.reshape(-1))
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=1e-6)


def test_gradient_reaches_the_logits_and_balanced_routing_is_minimal():
    logits, indices = _layers(n=2)
    leaves = [x.clone().requires_grad_() for x in logits]
    load_balancing_loss(leaves, indices, E).backward()
    assert all(x.grad is not None and x.grad.abs().sum() > 0 for x in leaves)
    uniform = [torch.zeros(12, E)]
    balanced = [torch.arange(12 * K).view(12, K) % E]
    assert float(load_balancing_loss(uniform, balanced, E)) == pytest.approx(K)  # the minimum
    one_expert = [torch.zeros(12, K, dtype=torch.long) + torch.tensor([0, 1])]
    assert float(load_balancing_loss(uniform, one_expert, E)) == pytest.approx(K)  # P uniform


def test_counts_and_statistics():
    indices = [torch.tensor([[0, 1], [0, 2], [0, 1]]), torch.tensor([[3, 4], [5, 0], [1, 2]])]
    mask = torch.tensor([1, 1, 0])
    counts = expert_counts(indices, E, mask)
    assert counts.tolist() == [[2, 1, 1, 0, 0, 0], [1, 0, 0, 1, 1, 1]]
    stats = load_statistics(counts)
    assert stats["max_load_share"] == pytest.approx((0.5 + 0.25) / 2)
    assert stats["max_load_share_worst_layer"] == pytest.approx(0.5)
    h0 = -(0.5 * math.log(0.5) + 2 * 0.25 * math.log(0.25))
    assert stats["load_entropy"] == pytest.approx((h0 + math.log(4)) / 2)


def test_bad_inputs_name_the_problem():
    logits, indices = _layers()
    with pytest.raises(ValueError, match="one \\(logits, indices\\) pair per sparse layer"):
        load_balancing_loss(logits, indices[:2], E)
    with pytest.raises(ValueError, match="mask has 3 tokens but the router logits have 20"):
        load_balancing_loss(logits, indices, E, torch.ones(3))
