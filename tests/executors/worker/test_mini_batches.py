"""Several optimizer steps per RL step: trainer.mini_batch_size x trainer.epochs in the worker.

One and two ranks, real DeepSpeed. The reference is the plain one-update step: a step of K
mini-batches x E epochs must equal, bit for bit, K x E one-update steps on those mini-batches
in that order with the rollout logprobs as the ratio's old logprobs (no recompute); parity is
checked on pre-update forwards only (`trainer.parity_scope`), and the rollout correction takes
its proximal logprobs from the scoring pass, before the first update.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker, ParityError
from tests.helpers.worker.cell import cached_completions, cell_config, to_batch

SEQS = 8  # the cell's batch: 2 prompts x 4 samples


@pytest.fixture(scope="module")
def batch():
    return to_batch(cached_completions("float32"))


def worker(stage=0, parity="strict", trainer=None, algorithm=None, prompts=2):
    config = cell_config(
        stage,
        1,
        "float32",
        parity=parity,
        rollout={"prompts_per_step": prompts},
        trainer={"lr": 1e-3, **(trainer or {})},  # large enough to move the logprobs
        algorithm={"kl_coef": 0.0, **(algorithm or {})},
    )
    return DeepSpeedTrainingWorker(config, device="cpu")


def weights_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def nudged(batch, seq: int):
    logprobs = batch.rollout_logprobs.clone()
    pos = int(batch.response_mask[seq].nonzero()[0])
    logprobs[seq, pos] = torch.nextafter(logprobs[seq, pos], torch.tensor(0.0))
    return dataclasses.replace(batch, rollout_logprobs=logprobs)


@pytest.mark.parametrize(
    "stage",
    [0, pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow), 3],
)
def test_mini_batches_and_epochs_are_one_update_steps_in_a_row(stage, batch):
    many = worker(stage, trainer={"mini_batch_size": 4, "epochs": 2})
    metrics = many.train_step(batch)
    assert metrics["updates"] == 4 and many.weight_version == 4 and metrics["skipped_update"] == 0
    assert metrics["parity/exact_match_fraction"] == 1.0  # the pre-update forwards only
    assert metrics["parity/num_tokens"] == batch.num_tokens == metrics["tokens"]
    assert metrics["clip_fraction"] > 0  # later updates see ratios away from 1: the clip acts
    # the reference: four plain steps of 4 sequences, old logprobs = the rollout's
    plain = worker(stage, parity="report", prompts=1)
    halves = [batch._rows(slice(0, 4)), batch._rows(slice(4, 8))]
    losses = [plain.train_step(halves[k % 2])["policy_loss"] for k in range(4)]
    assert weights_equal(many.export_weights(), plain.export_weights())
    assert metrics["policy_loss"] == pytest.approx(sum(losses) / 4, rel=1e-12)
    # the negative control: one update over the whole step lands elsewhere
    once = worker(stage)
    once.train_step(batch)
    assert not weights_equal(once.export_weights(), plain.export_weights())


def test_parity_scope_all_checks_every_sequence_before_the_first_update(batch):
    bad = nudged(batch, 6)  # a sequence of the second mini-batch
    checked = worker(trainer={"mini_batch_size": 4, "parity_scope": "all"})
    with pytest.raises(ParityError, match="sequence 6 of the shard"):
        checked.train_step(bad)
    assert checked.global_step == 0 and checked.weight_version == 0
    assert checked.train_step(batch)["parity/num_tokens"] == batch.num_tokens  # still usable
    first = worker(trainer={"mini_batch_size": 4, "parity_scope": "first"})
    metrics = first.train_step(bad)  # sequence 6 is never compared: its forward is post-update
    assert metrics["parity/num_tokens"] == int(batch.response_mask[:4].sum())
    assert metrics["parity/exact_match_fraction"] == 1.0 and first.weight_version == 2


def test_rollout_correction_takes_the_pre_update_logprobs_of_every_mini_batch(batch):
    """On-policy data: the correction's weights are 1 and its proximal logprobs, from the scoring
    pass, ARE the rollout's; so the steps equal mode 'none' bit for bit (a proximal taken
    after the first update would not: the second mini-batch's ratio would be 1)."""
    trainer = {"mini_batch_size": 4, "epochs": 2, "parity_scope": "first"}
    corrected = worker(
        parity="report", trainer=trainer, algorithm={"rollout_correction": "token_truncate"}
    )
    metrics = corrected.train_step(batch)
    assert metrics["parity/num_tokens"] == batch.num_tokens  # the pass ran whatever the scope
    assert metrics["correction/ratio_min"] == metrics["correction/ratio_max"] == 1.0
    plain = worker(parity="report", trainer=trainer)
    plain.train_step(batch)
    assert weights_equal(corrected.export_weights(), plain.export_weights())


def test_token_budget_and_packing_inside_mini_batches(batch):
    """Micro-batches planned inside each mini-batch by the token budget: the same updates as
    fixed micro-batches (fp32 rounding of the gradient sums aside), every one counted."""
    trainer = {"mini_batch_size": 4, "epochs": 2, "micro_batch_size": 4, "grad_clip": 0.0}
    budget = worker(trainer={**trainer, "max_tokens_per_micro_batch": 24})
    metrics = budget.train_step(batch)
    assert metrics["updates"] == 4 and metrics["parity/exact_match_fraction"] == 1.0
    fixed = worker(trainer=trainer)
    fixed.train_step(batch)
    a, b = budget.export_weights(), fixed.export_weights()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert diff < 1e-5


@pytest.mark.multiprocess
def test_two_ranks_zero3_scoring_pass_and_updates(tmp_path):
    """Two ranks: the scoring pass is a collective (a mismatch on one rank raises on both, before
    any update), and 2 mini-batches x 2 epochs equal four plain steps bit for bit."""
    from tests.helpers.worker.launch import run_ranks

    path = tmp_path / "completions.pt"
    torch.save(cached_completions("float32"), path)
    ranks, error = run_ranks(
        {"job": "tests.helpers.worker.mini_batch_job", "completions": {"float32": str(path)}},
        2,
        tmp_path,
        timeout=300,
    )
    assert error is None, error
    results = [r["mini_batch_job"] for r in ranks]
    assert "no optimizer step was taken" in results[1]["strict_error"]  # the nudged rank
    assert "other ranks" in results[0]["strict_error"]
    assert all(r["step_after_strict"] == 0 for r in results)
    metrics = results[0]["metrics"]
    assert metrics == results[1]["metrics"]  # all-reduced
    assert metrics["updates"] == 4 and metrics["parity/exact_match_fraction"] == 1.0
    assert metrics["parity/num_tokens"] == results[0]["tokens"]
    assert results[0]["weights_differ"] == []
