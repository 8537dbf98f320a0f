"""A mixture-of-experts policy's router terms in a step (executors/worker/policy/router_terms.py),
on the batch-invariant tiny Qwen3-MoE in-process: the expert load counts every real token's
top-k slots, the same integers padded or packed (a packed micro-batch's router rows are its
packed tokens: `forward_token_mask` picks the real ones of either layout; control: another
seed's routers load the experts otherwise); with a coefficient
the auxiliary loss joins the micro-batch's loss and its metric, with 0 the metric alone. A dense
policy has no router terms and reports none; a coefficient for it is refused by name."""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.micro_batches import plan
from rl_engine.executors.worker.policy.logprob_module import LogprobModule, micro_batch_logprobs
from rl_engine.executors.worker.policy.router_terms import RouterTerms, forward_token_mask
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from tests.helpers.worker.completions import two_groups

CPU = torch.device("cpu")
ONE_RANK = Collectives(0, 1, CPU)


def _config(model: str, coef: float) -> RunConfig:
    return RunConfig.from_dict({"model": model, "algorithm": {"router_aux_loss_coef": coef}})


@pytest.fixture(scope="module")
def moe():
    model, _ = load_model("tiny-qwen3-moe", seed=1)
    apply_batch_invariant(model)
    return model


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    comps, rewards = two_groups()
    return TrainBatch.from_completions(comps, rewards, samples_per_prompt=2, pad_token_id=0)


def _step(moe, batch, coef: float, packing: bool):
    """(RouterTerms after one micro-batch's forward and loss, that loss term)."""
    terms = RouterTerms(moe, _config("tiny-qwen3-moe", coef), layout_free=False)
    (mb,) = plan(batch, micro_batch_size=4, max_tokens=0, packing=packing)
    terms.start([[mb]], ONE_RANK.all_reduce)
    with terms.recording() as recorder:
        micro_batch_logprobs(LogprobModule(moe), mb, CPU)
    return terms, terms.loss(recorder, mb, scale=1), mb


def test_the_load_counts_every_real_tokens_slots_padded_or_packed(moe, batch):
    padded, term, padded_mb = _step(moe, batch, 0.0, packing=False)
    packed, _, packed_mb = _step(moe, batch, 0.0, packing=True)
    real = int(batch.attention_mask.sum())
    assert int(forward_token_mask(padded_mb).sum()) == int(forward_token_mask(packed_mb).sum())
    assert int(forward_token_mask(padded_mb).sum()) == real
    top_k = moe.config.num_experts_per_tok
    assert padded.counts.sum(dim=1).tolist() == [real * top_k] * len(padded.layers)
    assert torch.equal(packed.counts, padded.counts)
    other, _ = load_model("tiny-qwen3-moe", seed=2)
    apply_batch_invariant(other)
    assert not torch.equal(_step(other, batch, 0.0, packing=False)[0].counts, padded.counts)
    assert term is None  # coefficient 0: no loss term
    metrics = padded.metrics(ONE_RANK)
    assert metrics["router/aux_loss"] > 0  # reported with any coefficient
    assert 0 < metrics["router/max_load_share"] <= 1


def test_a_coefficient_adds_the_weighted_aux_loss_to_the_micro_batch(moe, batch):
    terms, term, _ = _step(moe, batch, 0.5, packing=False)
    aux = terms.metrics(ONE_RANK)["router/aux_loss"]
    assert term.requires_grad
    assert abs(float(term.detach()) - 0.5 * aux) <= 1e-6 * aux  # the whole mini-batch: share 1


def test_a_dense_policy_has_no_router_terms():
    dense, _ = load_model("tiny-llama")
    terms = RouterTerms(dense, _config("tiny-llama", 0.0), layout_free=False)
    assert not terms.active and terms.metrics(ONE_RANK) == {}
    with terms.recording() as recorder:
        assert recorder is None
    with pytest.raises(ValueError, match="router_aux_loss_coef is 0.1 but model 'tiny-llama'"):
        RouterTerms(dense, _config("tiny-llama", 0.1), layout_free=False)
