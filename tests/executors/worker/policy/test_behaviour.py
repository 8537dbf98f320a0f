"""VersionSnapshot: a rank's trainable weights at one version, swapped back in for a forward.

On a real transformers model (tiny-llama, patched): the snapshot's forward equals the
forward of the weights it copied, bit for bit, after an optimizer step changed them; after the
block the live weights are back, bitwise; frozen parameters are not copied (LoRA keeps only
its adapters). The control: the same forward without the snapshot differs.
"""

from __future__ import annotations

import torch

from rl_engine.executors.worker.policy.behaviour import VersionSnapshot
from rl_engine.logprobs import token_logprobs
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant

IDS = torch.tensor([[3, 17, 42, 8, 99, 5]])


def _policy():
    model, _ = load_model("tiny-llama", seed=0)
    apply_batch_invariant(model)
    return model


def _update(model) -> None:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    token_logprobs(model, IDS).sum().backward()
    optimizer.step()


def test_a_snapshot_computes_its_versions_bits_and_restores_the_live_weights():
    model = _policy()
    before = token_logprobs(model, IDS)
    snapshot = VersionSnapshot.take(model, version=0)
    _update(model)
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    after = token_logprobs(model, IDS)
    assert not torch.equal(after, before)  # the control: the update changed the bits
    with snapshot.swapped_in(model):
        assert torch.equal(token_logprobs(model, IDS), before)
    assert all(torch.equal(p, live[n]) for n, p in model.named_parameters())
    assert torch.equal(token_logprobs(model, IDS), after)


def test_frozen_parameters_are_not_copied():
    model = _policy()
    trainable = model.lm_head.weight
    for param in model.parameters():
        param.requires_grad_(param is trainable)
    snapshot = VersionSnapshot.take(model, version=3)
    assert snapshot.version == 3
    assert snapshot.nbytes == trainable.numel() * trainable.element_size()
