"""Training on a foreign engine's rollouts with each rollout correction (real DeepSpeed, real Ray).

The foreign engine is Hugging Face `generate` on tiny-llama in bf16: its logprobs
differ from the invariant trainer's by up to ~4e-3 per token. Each mode's threshold
C is the median |log ratio| (of tokens or of sequences) at that moment, so every
mode has tokens or sequences to truncate or drop, and others to keep.
The worker test checks each mode's policy loss against the definition computed
from the worker's own logprobs before the step: a dropped token (or sequence)
leaves the denominator, over micro-batches.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random

import pytest
import torch

from rl_engine.algorithms import CORRECTION_MODES, policy_loss, rollout_correction
from rl_engine.config import RunConfig
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker
from rl_engine.rollout import read_rollouts, write_rollouts
from tests.helpers.foreign_engine import hf_completions

MODEL, PROMPTS, GROUP = "tiny-llama", 4, 2
C = math.exp(0.0015)  # the job test's threshold: about half of the sequences
CORRECTION_KEYS = {
    "correction/ratio_mean",
    "correction/ratio_min",
    "correction/ratio_max",
    "correction/truncated_fraction",
    "correction/masked_fraction",
    "correction/masked_sequence_fraction",
    "correction/k3_kl",
    "correction/trainer_ppl",
    "correction/rollout_ppl",
}


@pytest.fixture(scope="module")
def foreign():
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1000) for _ in range(6)] for _ in range(PROMPTS)]
    return hf_completions(
        MODEL,
        torch.bfloat16,
        prompts,
        samples_per_prompt=GROUP,
        max_new_tokens=8,
        temperature=1.0,
        seed=0,
    )


def _rewards(completions) -> list[float]:
    return [sum(t % 2 == 0 for t in c.token_ids) / len(c.token_ids) for c in completions]


def _config(**sections) -> RunConfig:
    data = {
        "model": MODEL,
        "dtype": "bfloat16",
        "parity": "report",
        "rollout": {"prompts_per_step": PROMPTS, "samples_per_prompt": GROUP},
        "trainer": {"micro_batch_size": 4, "lr": 1e-6},  # 2 micro-batches: a global denominator
        "algorithm": {"correction_threshold": C},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values} if isinstance(values, dict) else values
    return RunConfig.from_dict(data)


def _median_threshold(batch: TrainBatch, trainer: torch.Tensor, mode: str) -> float:
    """exp(median |log ratio|) over tokens, or over sequences for the sequence modes."""
    mask = batch.response_mask
    log_ratio = torch.where(mask, trainer.double() - batch.rollout_logprobs.double(), 0.0)
    values = log_ratio.sum(dim=1) if mode.startswith("sequence") else log_ratio[mask]
    return max(math.exp(float(values.abs().median())), 1.0 + 1e-6)  # C must be > 1


def _expected_policy_loss(
    batch: TrainBatch, trainer: torch.Tensor, mode: str, threshold: float, aggregation: str
):
    """The definition, from the trainer's logprobs before the step (no DeepSpeed, no micro-batches)."""
    mask = batch.response_mask
    if mode == "none":  # PPO ratio against the rollout's logprobs, no weights
        loss, _ = policy_loss(
            trainer, batch.rollout_logprobs, batch.advantages, mask, aggregation=aggregation
        )
        return float(loss), int(mask.sum())
    c = rollout_correction(trainer, batch.rollout_logprobs, mask, mode=mode, threshold=threshold)
    per_token = -batch.advantages[:, None] * c.weights  # ratio to the proximal policy is 1
    kept_rows = c.mask.any(dim=1)
    if aggregation == "token-mean":
        return float(per_token[c.mask].sum() / c.mask.sum()), int(c.mask.sum())
    assert aggregation == "seq-mean-token-sum"
    rows = torch.where(c.mask, per_token, 0.0).sum(dim=1)[kept_rows]
    return float(rows.sum() / kept_rows.sum()), int(c.mask.sum())


@pytest.mark.slow
def test_each_correction_mode_trains_with_the_dropped_tokens_out_of_the_denominator(foreign):
    """One bf16 worker (real DeepSpeed, 1 rank, 2 micro-batches), two steps per mode."""
    batch = TrainBatch.from_completions(
        foreign, _rewards(foreign), samples_per_prompt=GROUP, pad_token_id=0
    )
    base = _config(algorithm={"kl_coef": 0.0})
    worker = DeepSpeedTrainingWorker(base, device="cpu")
    aggregations = {"sequence_mask": "seq-mean-token-sum"}  # dropped sequences leave B too
    for mode in CORRECTION_MODES:
        aggregation = aggregations.get(mode, "token-mean")
        trainer = worker.compute_logprobs(batch)  # the weights the step's forward will see
        threshold = _median_threshold(batch, trainer, mode)
        algo = dataclasses.replace(
            base.algorithm,
            rollout_correction=mode,
            loss_aggregation=aggregation,
            correction_threshold=threshold,
        )
        worker.config = dataclasses.replace(base, algorithm=algo)
        expected, kept = _expected_policy_loss(batch, trainer, mode, threshold, aggregation)
        first = worker.train_step(batch)
        second = worker.train_step(batch)
        for m in (first, second):
            assert CORRECTION_KEYS <= m.keys() and math.isfinite(m["loss"]), mode
            assert m["parity/exact_match_fraction"] < 1.0  # HF's bf16 decode != the trainer
        assert first["policy_loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6), mode
        dropped = first["correction/masked_fraction"]
        assert dropped == pytest.approx(1 - kept / batch.num_tokens), mode
        if mode.endswith("_mask"):
            assert 0.0 < dropped < 1.0, f"{mode}: C should drop some tokens, not all"
        else:
            assert dropped == 0.0
        truncated = first["correction/truncated_fraction"]
        assert (truncated > 0.0) == mode.endswith("_truncate"), mode
        assert first["correction/ratio_min"] < 1.0 < first["correction/ratio_max"]


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_job_trains_on_a_rollout_file_and_saves_its_steps(foreign, tmp_path, job_ray):
    """Ray + DeepSpeed job on HF generate's file: sequence_mask, parity 'report' by default."""
    source = write_rollouts(tmp_path / "hf.jsonl", foreign)
    config = _config(
        output_dir=str(tmp_path / "run"),
        steps=2,
        parity=None,
        rollout={"prompts_per_step": 2, "source": str(source), "save": True},
        trainer={"micro_batch_size": 2, "lr": 1e-3},
        algorithm={"rollout_correction": "sequence_mask"},
    )
    assert config.parity == "report"
    history = run_job(config)
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1]
    for m in history:
        assert CORRECTION_KEYS <= m.keys() and math.isfinite(m["loss"])
        assert m["parity/num_tokens"] > 0 and m["parity/exact_match_fraction"] < 1.0
    for step in (0, 1):
        saved = read_rollouts(tmp_path / "run" / "rollouts" / f"step_{step}.jsonl")
        served = foreign[step * 4 : (step + 1) * 4]  # 2 groups of 2 per step, in file order
        assert [c.token_ids for c in saved] == [c.token_ids for c in served]
        assert all(torch.equal(a.logprobs, b.logprobs) for a, b in zip(saved, served))
        task_rewards = [sum(t < 125 for t in c.token_ids) / len(c.token_ids) for c in served]
        assert [c.reward for c in saved] == task_rewards  # the file had none: the count task's
        assert history[step]["reward_mean"] == pytest.approx(sum(task_rewards) / 4)
