"""The worker with packed micro-batches and a token budget, on real DeepSpeed.

Chain (torch.equal): the RolloutEngine's logprobs == the worker's packed logprobs
(`trainer.packing`, with and without `trainer.max_tokens_per_micro_batch`) == its
padded logprobs, for the four dense and the four MoE families in fp32 and bf16 (one rank, ZeRO-0;
ZeRO 1-3 and two ranks: tests/parity/test_worker_matrix.py runs every cell
packed, and the 2-rank ZeRO-3 job below runs ranks with different micro-batch
counts). The loss does not depend on the packing: one step under three budgets
gives per-token losses that are torch.equal and gradients equal to fp32 rounding
(||g1 - g2|| / ||g1|| <= 1e-6), for every loss aggregation; one fixed packing is
bitwise reproducible run to run. Negative control: without invariance the packed
worker's logprobs are not the rollout's.
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import rl_engine.algorithms.losses as losses
from rl_engine.config import RunConfig
from rl_engine.executors.worker.batch_checks import micro_batches
from rl_engine.executors.worker.ds_config import build_deepspeed_config
from rl_engine.executors.worker.policy.worker import BatchError, DeepSpeedTrainingWorker
from rl_engine.logprobs.packing import plan_micro_batches
from tests.helpers.worker.cell import cell_config, generate, rollout_engine, to_batch
from tests.helpers.worker.launch import run_ranks

FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral") + (
    "tiny-qwen3-moe",  # mixture of experts: routed tokens of a packed row, as of a padded one
    "tiny-qwen2-moe",
    "tiny-mixtral",
    "tiny-olmoe",
)
# make test: every family once, the dtypes alternating; the other dtype of each: make test-all
QUICK = {(m, ("float32", "bfloat16")[i % 2]) for i, m in enumerate(FAMILIES)}
BUDGET = 24  # tokens: the cells' sequences hold 6 to 15, so 2 or 3 share a micro-batch


@functools.cache
def _completions(model: str, dtype: str):
    config = cell_config(0, 1, dtype, model=model)
    return generate(rollout_engine(config), config, seed=5)


def _config(model="tiny-llama", dtype="float32", **trainer) -> RunConfig:
    # max_new_tokens as the cells generate (tests/helpers/worker/cell.py)
    return cell_config(0, 1, dtype, model=model, trainer=trainer, rollout={"max_new_tokens": 6})


def _with(worker, **trainer) -> None:
    """Switch the worker's micro-batch layout (read at every step)."""
    worker.config = dataclasses.replace(
        worker.config, trainer=dataclasses.replace(worker.config.trainer, **trainer)
    )


def _cases():
    for model in FAMILIES:
        for dtype in ("float32", "bfloat16"):
            marks = [] if (model, dtype) in QUICK else [pytest.mark.slow, pytest.mark.exhaustive]
            yield pytest.param(model, dtype, marks=marks, id=f"{model}-{dtype}")


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize(("model", "dtype"), list(_cases()))
def test_packed_worker_logprobs_equal_rollout_and_padded(model, dtype):
    batch = to_batch(_completions(model, dtype))
    mask = batch.response_mask
    worker = DeepSpeedTrainingWorker(
        _config(model, dtype, packing=True, max_tokens_per_micro_batch=BUDGET), device="cpu"
    )
    layouts = {
        "packed, budget": {},
        "packed, micro_batch_size": {"max_tokens_per_micro_batch": 0},
        "padded": {"packing": False},
        "padded, budget": {"packing": False, "max_tokens_per_micro_batch": 2 * BUDGET},
    }
    for name, change in layouts.items():
        _with(worker, **{"packing": True, "max_tokens_per_micro_batch": BUDGET, **change})
        lp = worker.compute_logprobs(batch)
        assert torch.equal(lp[mask], batch.rollout_logprobs[mask]), f"{name}: trainer != rollout"
        assert not lp[~mask].any(), f"{name}: unscored positions must be 0"
    _with(worker, packing=True, max_tokens_per_micro_batch=BUDGET)
    groups = plan_micro_batches(
        batch.attention_mask.sum(1).tolist(), max_sequences=4, max_tokens=BUDGET
    )
    assert len(groups) > 2, "the budget should split the step into more micro-batches"
    metrics = worker.train_step(batch)  # parity strict: raises on any mismatch
    assert metrics["parity/exact_match_fraction"] == 1.0 and metrics["grad_norm"] > 0


def test_negative_control_packed_without_invariance_differs_from_rollout():
    batch = to_batch(_completions("tiny-llama", "float32"))
    config = cell_config(
        0, 1, "float32", batch_invariant=False, parity="report", trainer={"packing": True}
    )
    lp = DeepSpeedTrainingWorker(config, device="cpu").compute_logprobs(batch)
    mask = batch.response_mask
    assert not torch.equal(lp[mask], batch.rollout_logprobs[mask])


# ----------------------------------------------------------------------------- the loss


def _instrumented_step(worker, batch, monkeypatch):
    """One train_step that updates nothing; returns (per-token policy losses (B, T-1) in the
    shard's layout, NaN off the mask; the gradients the optimizer would have applied)."""
    per_token = torch.full(batch.response_mask.shape, float("nan"), dtype=torch.float32)
    current = {}
    micro_loss, aggregate = worker._micro_loss, losses.aggregate

    def traced_micro_loss(slot, mb, corrections):
        current["mb"] = mb
        return micro_loss(slot, mb, corrections)

    def traced_aggregate(values, mask, aggregation):
        rows = list(current["mb"].sequences)
        width = values.shape[1]
        block = per_token[rows, :width]
        per_token[rows, :width] = torch.where(mask, values.detach(), block)
        return aggregate(values, mask, aggregation)

    grads = {}

    def capture(*args, **kwargs):
        for name, p in worker.module.named_parameters():
            grads[name] = p.grad.detach().clone()

    monkeypatch.setattr(worker, "_micro_loss", traced_micro_loss)
    monkeypatch.setattr(losses, "aggregate", traced_aggregate)
    monkeypatch.setattr(worker.guard, "_step", capture)
    worker.train_step(batch)
    monkeypatch.undo()
    return per_token, grads


def _relative_error(a: dict, b: dict) -> float:
    diff = torch.cat([(a[k] - b[k]).double().flatten() for k in a])
    return float(diff.norm() / torch.cat([a[k].double().flatten() for k in a]).norm())


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_the_loss_does_not_depend_on_the_packing(aggregation, monkeypatch):
    """Budgets 0 (micro_batch_size slices), 24 and 40 tokens: per-token losses torch.equal,
    gradients equal to fp32 rounding; the padded layout too. One fixed packing twice: equal."""
    batch = to_batch(_completions("tiny-llama", "float32"))
    config = cell_config(
        0,
        1,
        "float32",
        parity="report",
        trainer={"packing": True, "grad_clip": 0.0},
        algorithm={"kl_coef": 0.0, "loss_aggregation": aggregation},
    )
    worker = DeepSpeedTrainingWorker(config, device="cpu")
    runs = {}
    for name, change in {
        "budget 0": {"max_tokens_per_micro_batch": 0},
        "budget 24": {"max_tokens_per_micro_batch": 24},
        "budget 40": {"max_tokens_per_micro_batch": 40},
        "padded": {"packing": False, "max_tokens_per_micro_batch": 0},
        "budget 24 again": {"max_tokens_per_micro_batch": 24},
    }.items():
        _with(worker, **{"packing": True, **change})
        runs[name] = _instrumented_step(worker, batch, monkeypatch)
    counts = {
        len(
            micro_batches(
                batch, vocab_size=1000, micro_batch_size=4, device="cpu", packing=True, max_tokens=b
            )
        )
        for b in (0, 24, 40)
    }
    assert len(counts) == 3, f"the three budgets should pack differently, got counts {counts}"
    mask = batch.response_mask
    first, first_grads = runs["budget 0"]
    assert not first[mask].isnan().any() and first[mask].abs().sum() > 0
    for name, (tokens, grads) in runs.items():
        assert torch.equal(tokens[mask], first[mask]), f"{name}: per-token losses differ"
        assert _relative_error(first_grads, grads) <= 1e-6, name
    again = runs["budget 24 again"][1]
    assert all(torch.equal(again[k], runs["budget 24"][1][k]) for k in again), (
        "one packing, two runs: gradients must be bitwise equal"
    )


def test_fixed_packing_is_bitwise_reproducible_across_fresh_workers():
    batch = to_batch(_completions("tiny-llama", "float32"))
    config = _config(packing=True, max_tokens_per_micro_batch=BUDGET)
    results = []
    for _ in range(2):
        worker = DeepSpeedTrainingWorker(config, device="cpu")
        metrics = worker.train_step(batch)
        results.append((metrics, worker.export_weights()))
    (m1, w1), (m2, w2) = results
    assert m1 == m2
    assert all(torch.equal(w1[k], w2[k]) for k in w1)


# ----------------------------------------------------------------------------- config and errors


def test_a_sequence_longer_than_the_budget_is_a_batch_error_naming_both_numbers():
    batch = to_batch(_completions("tiny-llama", "float32"))
    longest = int(batch.attention_mask.sum(1).max())
    config = _config(packing=True, max_tokens_per_micro_batch=longest - 1)
    worker = DeepSpeedTrainingWorker(config, device="cpu")
    with pytest.raises(
        BatchError,
        match=rf"has {longest} tokens, more than the token budget of {longest - 1}.*trainer\.max_tokens_per_micro_batch = {longest - 1}",
    ):
        worker.train_step(batch)


def test_budget_config():
    config = _config(packing=True, max_tokens_per_micro_batch=64)
    ds = build_deepspeed_config(config, 1)
    assert ds["gradient_accumulation_steps"] == 1 and ds["train_micro_batch_size_per_gpu"] == 4
    with pytest.raises(ValueError, match="rollout.max_new_tokens \\+ 1 = 17"):
        RunConfig.from_dict(
            {"rollout": {"max_new_tokens": 16}, "trainer": {"max_tokens_per_micro_batch": 10}}
        )
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch must be an int >= 0"):
        RunConfig.from_dict({"trainer": {"max_tokens_per_micro_batch": -1}})
    with pytest.raises(ValueError, match="trainer.packing must be true or false"):
        RunConfig.from_dict({"trainer": {"packing": "yes"}})
    odd = RunConfig.from_dict(
        {
            "rollout": {"prompts_per_step": 3, "samples_per_prompt": 1},
            "trainer": {"micro_batch_size": 2, "max_tokens_per_micro_batch": 64},
        }
    )
    assert odd.sequences_per_rank == 3  # a budget does not need micro_batch_size to divide it


# ----------------------------------------------------------------------------- two ranks


@pytest.mark.multiprocess
def test_two_ranks_zero3_different_micro_batch_counts_exact_logprobs_close_metrics(tmp_path):
    completions = _completions("tiny-llama", "float32")
    path = tmp_path / "completions.pt"
    torch.save(completions, path)
    ranks, error = run_ranks(
        {"job": "tests.helpers.parity.packing_job", "completions": {"float32": str(path)}},
        2,
        tmp_path,
        timeout=300,
    )
    assert error is None, error
    results = [r["packing_job"] for r in ranks]
    counts = [r["micro_batches"] for r in results]
    assert counts[0] != counts[1], f"the ranks should plan different counts, got {counts}"
    for r in results:
        assert torch.equal(r["lp"][r["mask"]], r["rollout_lp"][r["mask"]]), "trainer != rollout"
        assert torch.equal(r["lp"], r["padded_lp"])
        assert r["metrics"]["parity/exact_match_fraction"] == 1.0
        assert r["metrics"]["step"] == 1 and r["metrics"]["grad_norm"] > 0
    assert "no optimizer step was taken" in results[1]["strict_error"]  # the nudged rank
    assert "other ranks" in results[0]["strict_error"]
    assert all(r["step_after_strict"] == 0 for r in results), "no step after a mismatch"
    assert results[0]["metrics"] == results[1]["metrics"]  # all-reduced
    # Close, not equal: the plain update sums micro-batches' losses and gradients in layout order,
    # and the packed and padded plans cut the shard into different micro-batches; the logprobs
    # above are exact. trainer.layout_invariant makes these equal too.
    padded = results[0]["padded_metrics"]
    for key in ("loss", "policy_loss", "entropy", "grad_norm"):
        assert results[0]["metrics"][key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key
