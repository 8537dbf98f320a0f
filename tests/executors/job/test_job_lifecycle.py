"""Checkpoints, resume, export and collective timeouts with real Ray actors and real DeepSpeed.

The pytest process's shared local Ray cluster (the `job_ray` fixture) serves the module.
"""

from __future__ import annotations

import pytest
import ray
import torch

from rl_engine.cli import main
from rl_engine.executors.job import job_checkpoints as ckpt
from rl_engine.executors.job.ray_job import run_job
from rl_engine.executors.job.run_dir import read_metrics
from tests.helpers.job.jobs import check_complete_run, job_config, resumed_copy, without_timings

pytestmark = [pytest.mark.multiprocess]


@pytest.mark.slow  # two jobs each: 2 steps, 1 resumed step
@pytest.mark.parametrize(
    ("num_ranks", "zero_stage", "layout"),
    [
        # packed (the default), micro_batch_size sequences per micro-batch
        pytest.param(1, 0, {}, marks=pytest.mark.exhaustive),
        pytest.param(2, 3, {}, marks=pytest.mark.exhaustive),
        pytest.param(1, 0, {"packing": False}, marks=pytest.mark.exhaustive),  # padded layout
        # packed, 2-3 sequences per micro-batch; make test resumes such a run, with mini-batches
        # and epochs too, in test_algorithm_job
        pytest.param(2, 3, {"max_tokens_per_micro_batch": 30}, marks=pytest.mark.exhaustive),
    ],
    ids=["1rank-zero0", "2ranks-zero3", "1rank-padded", "2ranks-zero3-budget"],
)
def test_stopped_and_resumed_run_equals_uninterrupted(
    tmp_path, job_ray, num_ranks, zero_stage, layout
):
    """Run A: 2 steps, a checkpoint after each. Run B: A's copy cut back to its step-1
    checkpoint, then resumed to 2 steps. metrics.jsonl of A == of B on every key but the
    `time/` ones, parity 1.0 at every step. With a token budget the micro-batch plan (a function
    of the lengths) is the same too. (The checkpoint after step 1 already carries AdamW moments,
    sampling state and a weight version.) A run stopped by a signal writes the same checkpoint
    (test_job_faults: SIGTERM), and a killed one resumes from its last (the weight-sync kill)."""
    trainer = {"num_ranks": num_ranks, "zero_stage": zero_stage, **layout}
    whole = tmp_path / "whole"
    history = run_job(job_config(whole, steps=2, trainer=trainer, checkpoint={"every": 1}))
    check_complete_run(whole, history, num_ranks)
    part = resumed_copy(whole, tmp_path / "part", step=1)

    expected = without_timings(whole)
    assert [m["step"] for m in expected] == [0, 1]
    assert without_timings(part) == expected
    assert all(m["parity/exact_match_fraction"] == 1.0 for m in expected)
    assert [m["weight_version"] for m in expected] == [1, 2]
    timings = read_metrics(part)[-1]
    for phase in ("step", "rollout", "batch", "train", "weight_sync", "driver_overhead"):
        assert timings[f"time/{phase}"] >= 0
    assert ckpt.latest(part).step == 2 and ckpt.complete_tags(part) == ["step000001", "step000002"]


@pytest.mark.slow  # 15-50 s: a job, an export and one more DeepSpeed rank
@pytest.mark.exhaustive  # make test exports in test_moe_job (logprobs equal) and test_ppo_job
def test_export_is_a_hf_folder_whose_patched_logprobs_equal_the_trainers(tmp_path, job_ray):
    """checkpoint after step 1 -> export -> from_pretrained -> patched RolloutEngine samples;
    a DeepSpeed rank restored from the same checkpoint scores those tokens: torch.equal."""
    from transformers import AutoModelForCausalLM

    from rl_engine.executors.job.actors.trainers import TrainerActor
    from rl_engine.executors.job.rollouts import step_sampling
    from rl_engine.executors.worker.batch import TrainBatch
    from rl_engine.patching import apply_batch_invariant
    from rl_engine.rollout import RolloutEngine

    run, out = tmp_path / "run", tmp_path / "hf"
    config = job_config(run, steps=2, checkpoint={"every": 1})
    run_job(config)
    assert main(["export", str(run), "--to", str(out), "--step", "1"]) == 0
    assert (out / "config.json").is_file() and (out / "model.safetensors").is_file()
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    step1, step2 = ckpt.at_step(run, 1).load_weights(), ckpt.at_step(run, 2).load_weights()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, step1[name]), name
    assert any(not torch.equal(step1[k], step2[k]) for k in step1)  # --step chose step 1

    apply_batch_invariant(model)
    engine = RolloutEngine(model, device="cpu", max_batch_size=4)
    prompts = [[5, 9, 31, 4, 77], [8, 8, 2]]
    completions = engine.generate(prompts, step_sampling(config, 7, None), progress=False)
    batch = TrainBatch.from_completions(
        completions, [0.0] * len(completions), samples_per_prompt=4, pad_token_id=0
    )
    trainer = TrainerActor.options(num_cpus=1).remote(config, 0, 1)
    ray.get(trainer.start.remote("127.0.0.1", ray.get(trainer.free_port.remote()), None))
    ray.get(trainer.load_checkpoint.remote(str(ckpt.at_step(run, 1).deepspeed_dir)))
    trainer_logprobs = ray.get(trainer.compute_logprobs.remote(batch))
    assert batch.num_tokens > 0
    assert torch.equal(trainer_logprobs, batch.rollout_logprobs)
    assert main(["export", str(run), "--to", str(out)]) == 2  # never into a non-empty folder


@pytest.mark.deadline  # a 3 s collective timeout
def test_a_rank_left_alone_in_a_collective_fails_after_the_timeout(tmp_path, job_ray):
    """Rank 1 never joins rank 0's train_step: rank 0 raises TimeoutError naming the setting."""
    from rl_engine.executors.job.actors.trainers import TrainerActor
    from rl_engine.executors.worker.batch import TrainBatch
    from rl_engine.rollout import Completion

    config = job_config(tmp_path / "run", trainer={"num_ranks": 2, "collective_timeout_s": 3})
    ranks = [TrainerActor.options(num_cpus=1).remote(config, r, 2) for r in range(2)]
    port = ray.get(ranks[0].free_port.remote())
    ray.get([r.start.remote("127.0.0.1", port, None) for r in ranks])
    completions = [
        Completion(
            prompt_ids=[3, 4],
            token_ids=[5, 6],
            logprobs=torch.zeros(2),
            finish_reason="length",
            weight_version=0,
            prompt_index=i // 4,
            sample_index=i % 4,
        )
        for i in range(8)
    ]
    batch = TrainBatch.from_completions(
        completions, [0.0] * 8, samples_per_prompt=4, pad_token_id=0
    )
    with pytest.raises(ray.exceptions.RayTaskError) as err:
        ray.get(ranks[0].train_step.remote(batch.shard(0, 2)), timeout=120)
    assert isinstance(err.value.cause, TimeoutError)
    assert "trainer.collective_timeout_s = 3 s" in str(err.value.cause)
    for rank in ranks:
        ray.kill(rank)
