"""A tied embedding / LM-head weight's gradient formed once at the end of the backward: the
same bits as autograd's sum of the two, with no dense embedding gradient and no head
gradient held through the decoder's backward."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from rl_engine.executors.worker.policy import logprob_module as policy_module
from rl_engine.executors.worker.policy import tied_gradient
from rl_engine.executors.worker.policy.logprob_module import LogprobModule
from rl_engine.kernels.common.embedding import add_embedding_grad_
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("padding_idx", [None, 3])
def test_add_embedding_grad_is_autograds_sum_bit_for_bit(dtype, padding_idx):
    g = torch.Generator().manual_seed(0)
    vocab, hidden = 50, 16
    ids = torch.randint(0, 12, (6, 40), generator=g)  # many repeats: rounding order shows
    grad_out = torch.randn(6, 40, hidden, generator=g).to(dtype)
    head = torch.randn(vocab, hidden, generator=g).to(dtype)
    head[20:25] = -0.0  # rows no id touches: the sum turns -0.0 into +0.0
    head[ids[0, 0]] = -0.0
    weight = torch.zeros(vocab, hidden, dtype=dtype, requires_grad=True)
    F.embedding(ids, weight, padding_idx=padding_idx).backward(grad_out)
    expected = head.clone().add_(weight.grad)  # autograd's in-place sum of the two
    got = add_embedding_grad_(head.clone(), ids, grad_out, padding_idx)
    assert torch.equal(_bits(got), _bits(expected))


def _policy(name: str, invariant: bool):
    model, _ = load_model(name, dtype=torch.bfloat16, seed=3)
    if invariant:
        apply_batch_invariant(model)
    return model


def _grads(model, ids, targets, tied: bool):
    module = LogprobModule(model)
    module.zero_grad(set_to_none=True)
    with contextlib.nullcontext() if tied else _no_tying():
        logp = module(ids, torch.ones_like(ids), targets, 1.0)
    (logp * torch.linspace(-1.0, 2.0, logp.numel()).view_as(logp)).sum().backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@contextlib.contextmanager
def _no_tying():
    """The worker's module as before: autograd sums the head's and the embedding's gradients."""

    @contextlib.contextmanager
    def off(policy):
        yield None

    original = policy_module.tied_head_gradient
    policy_module.tied_head_gradient = off
    try:
        yield
    finally:
        policy_module.tied_head_gradient = original


@pytest.mark.parametrize("invariant", [True, False])
@pytest.mark.parametrize("batch", [(3, 9), (4, 40)])  # 24 rows <= H (deferred), 156 > H (not)
def test_worker_module_gradients_are_unchanged(invariant, batch):
    model = _policy("tiny-qwen3", invariant)
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, batch, generator=g)
    ids[:, 1] = ids[:, 0]  # repeated ids within a row
    targets = ids[:, 1:].clone()
    logp_before, before = _grads(model, ids, targets, tied=False)
    logp_after, after = _grads(model, ids, targets, tied=True)
    assert torch.equal(_bits(logp_before), _bits(logp_after))
    assert before.keys() == after.keys()
    for name in before:
        assert torch.equal(_bits(before[name]), _bits(after[name])), name


def test_the_head_defers_only_within_the_hidden_size(monkeypatch):
    """Rows <= H: the head returns no weight gradient and the join forms it (one V x H);
    more rows: the head returns it and the embedding's backward runs as before."""
    model = _policy("tiny-qwen3", True)
    hidden = model.config.hidden_size
    joined = []
    original = tied_gradient.add_embedding_grad_

    def spy(*args):
        joined.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(tied_gradient, "add_embedding_grad_", spy)
    for rows, deferred in ((hidden // 2, True), (hidden + 8, False)):
        joined.clear()
        ids = torch.randint(0, model.config.vocab_size, (1, rows + 1))
        module = LogprobModule(model)
        module(ids, torch.ones_like(ids), ids[:, 1:].clone(), 1.0).sum().backward()
        assert bool(joined) == deferred, rows


def test_no_join_without_grad_or_without_a_trained_tied_weight():
    model = _policy("tiny-qwen3", True)
    with torch.no_grad(), tied_gradient.tied_head_gradient(model) as deferred:
        assert deferred is None
    model.get_input_embeddings().weight.requires_grad_(False)  # frozen (a LoRA base)
    with tied_gradient.tied_head_gradient(model) as deferred:
        assert deferred is None
    model.get_input_embeddings().weight.requires_grad_(True)
    with tied_gradient.tied_head_gradient(model) as deferred:
        assert deferred == []
    assert not model.get_input_embeddings()._forward_hooks  # the hook is gone afterwards
