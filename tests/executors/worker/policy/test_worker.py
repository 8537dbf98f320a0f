"""DeepSpeedTrainingWorker in this process (1 rank, real DeepSpeed on the CPU accelerator).

Errors before any step (bad DeepSpeed configs, bad batches), strict parity
errors, invariance off with rollout correction, loss normalisation over micro-batches, and the
exported state dict.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from rl_engine.algorithms import policy_loss
from rl_engine.executors import BatchError
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.policy.worker import DeepSpeedTrainingWorker, ParityError
from rl_engine.models import load_model
from rl_engine.patching import is_patched
from tests.helpers.worker.cell import (
    cached_completions,
    cell_config,
    generate,
    nudged,
    rollout_engine,
    to_batch,
)


def make_worker(stage: int = 0, dtype: str = "float32", **overrides) -> DeepSpeedTrainingWorker:
    return DeepSpeedTrainingWorker(cell_config(stage, 1, dtype, **overrides), device="cpu")


@pytest.fixture(scope="module")
def batch() -> TrainBatch:
    return to_batch(cached_completions("float32"))


@pytest.fixture(scope="module")
def worker() -> DeepSpeedTrainingWorker:
    """A worker that never takes a step in this module (only errors and no-grad forwards)."""
    return make_worker()


def weights_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------ DeepSpeed config errors

BAD_DEEPSPEED = [
    (
        {"zero_optimization": {"stage": 7}},
        r"DeepSpeed rejected the config: deepspeed\.zero_optimization\.stage: ",
    ),
    (
        {"zero_optimization": {"stagex": 1}},
        r"deepspeed\.zero_optimization\.stagex: Extra inputs are not permitted",
    ),
    ({"bf16": {"enabled": True}}, r"deepspeed\.bf16\.enabled is True but dtype is 'float32'"),
    ({"fp16": {"enabled": True}}, r"deepspeed\.fp16\.enabled"),
    (
        {"train_micro_batch_size_per_gpu": 3},
        r"deepspeed\.train_micro_batch_size_per_gpu = 3 contradicts",
    ),
    ({"gradient_accumulation_steps": 4}, r"deepspeed\.gradient_accumulation_steps = 4 contradicts"),
    ({"train_batch_size": 5}, r"deepspeed\.train_batch_size = 5 contradicts"),
    (
        {"gradient_clipping": 0.5},
        r"deepspeed\.gradient_clipping = 0\.5 contradicts .*trainer\.grad_clip",
    ),
    (
        {"zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"}},
        r"deepspeed\.zero_optimization\.reduce_bucket_size is 'auto'",
    ),
    (
        {"optimizer": {"type": "Adam", "params": {"lr": 1e-3}}},
        r"deepspeed\.optimizer is not supported",
    ),
    ({"zero_optimization": 3}, r"deepspeed\.zero_optimization must be an object"),
]


@pytest.mark.parametrize(
    ("ds", "match"), BAD_DEEPSPEED, ids=[m.split("\\")[-1][:30] for _, m in BAD_DEEPSPEED]
)
def test_invalid_deepspeed_config_raises_before_any_engine(ds, match):
    with pytest.raises(ValueError, match=match):
        make_worker(trainer={"deepspeed": ds})


def test_bf16_must_be_on_for_bfloat16():
    with pytest.raises(
        ValueError, match=r"deepspeed\.bf16\.enabled is False but dtype is 'bfloat16'"
    ):
        make_worker(dtype="bfloat16", trainer={"deepspeed": {"bf16": {"enabled": False}}})


def test_deepspeed_json_path_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        make_worker(trainer={"deepspeed": str(tmp_path / "missing.json")})
    (tmp_path / "broken.json").write_text("{stage: 1")
    with pytest.raises(ValueError, match="is not valid JSON"):
        make_worker(trainer={"deepspeed": str(tmp_path / "broken.json")})


def test_world_size_must_match_num_ranks():
    config = cell_config(0, 2, "float32", model="tiny-llama")
    with pytest.raises(ValueError, match="trainer.num_ranks=2 but WORLD_SIZE=1"):
        DeepSpeedTrainingWorker(config, device="cpu")


def test_device_is_checked():
    config = cell_config(0, 1, "float32")
    with pytest.raises(TypeError, match="device must be a str or torch.device"):
        DeepSpeedTrainingWorker(config, device=0)
    with pytest.raises(ValueError, match="unsupported device"):
        DeepSpeedTrainingWorker(config, device="meta")
    with pytest.raises(ValueError, match="needs DS_ACCELERATOR=cuda|CUDA is not available"):
        DeepSpeedTrainingWorker(config, device="cuda")


# ------------------------------------------------------------------ bad batches, before any step


def test_bad_batches_raise_before_a_step(worker, batch):
    before = worker.export_weights()
    ids = batch.input_ids.clone()
    ids[2, 3] = worker.vocab_size + 5
    with pytest.raises(
        BatchError,
        match=rf"bad batch on rank\(s\) 0; no forward was run: rank 0: sequence 2: position 3 "
        rf"\(a token\) holds token id {worker.vocab_size + 5}",
    ):
        worker.train_step(dataclasses.replace(batch, input_ids=ids))
    with pytest.raises(ValueError, match="response_mask selects no tokens"):
        worker.train_step(
            dataclasses.replace(batch, response_mask=torch.zeros_like(batch.response_mask))
        )
    with pytest.raises(ValueError, match="shard has 4 sequences; a step takes exactly"):
        worker.train_step(batch.shard(0, 2))
    no_tokens_first = batch.response_mask.clone()
    no_tokens_first[:4] = False  # micro-batch 0 = sequences 0..3
    with pytest.raises(
        ValueError, match=r"micro-batch 0 \(sequences 0..3\) scores no completion token"
    ):
        worker.train_step(dataclasses.replace(batch, response_mask=no_tokens_first))
    with pytest.raises(BatchError, match="batch must be a TrainBatch"):
        worker.train_step({"input_ids": batch.input_ids})
    with pytest.raises(ValueError, match="sequence 2"):
        worker.compute_logprobs(dataclasses.replace(batch, input_ids=ids))
    assert worker.global_step == 0 and weights_equal(before, worker.export_weights())


def test_export_weights_are_the_hf_state_dict(worker):
    exported = worker.export_weights()
    reference, _ = load_model("tiny-llama", seed=3)
    expected = reference.state_dict()
    assert list(exported) == list(expected)
    assert all(torch.equal(exported[k], expected[k]) for k in expected), (
        "initial weights must be the seed's"
    )
    assert exported["lm_head.weight"] is exported["model.embed_tokens.weight"]  # tied: one tensor


def test_load_checkpoint_needs_a_checkpoint(worker, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        worker.load_checkpoint(tmp_path / "nothing")


# ------------------------------------------------------------------ strict parity


@pytest.mark.parametrize("stage", [0, pytest.param(3, marks=pytest.mark.slow)])
def test_strict_parity_names_first_mismatch_and_skips_the_update(stage, batch):
    worker = make_worker(stage)
    before = worker.export_weights()
    bad = nudged(batch, 1, 6)  # sequence 1 is in micro-batch 0, sequence 6 in micro-batch 1
    with pytest.raises(ParityError) as err:
        worker.train_step(bad)
    pos = int(batch.response_mask[1].nonzero()[1])
    assert (err.value.sequence, err.value.position) == (1, pos)
    assert err.value.rollout_logprob == float(bad.rollout_logprobs[1, pos])
    assert err.value.trainer_logprob == float(batch.rollout_logprobs[1, pos])
    assert "sequence 1 of the shard, completion token 1" in str(err.value)
    assert worker.global_step == 0 and weights_equal(before, worker.export_weights())
    # Nothing was accumulated: the next (clean) step equals a fresh worker's first step.
    metrics = worker.train_step(batch)
    fresh = make_worker(stage)
    assert metrics == fresh.train_step(batch)
    assert weights_equal(worker.export_weights(), fresh.export_weights())


def test_parity_error_survives_pickling():
    """Ray ships exceptions between processes: the details must survive."""
    import pickle

    err = pickle.loads(
        pickle.dumps(
            ParityError(
                "m", rank=1, sequence=2, position=3, trainer_logprob=-1.0, rollout_logprob=-1.5
            )
        )
    )
    assert (
        str(err),
        err.rank,
        err.sequence,
        err.position,
        err.trainer_logprob,
        err.rollout_logprob,
    ) == ("m", 1, 2, 3, -1.0, -1.5)
    batch_error = pickle.loads(pickle.dumps(BatchError("bad batch on rank(s) 1", ranks=(1,))))
    assert isinstance(batch_error, ValueError) and batch_error.ranks == (1,)
    assert str(batch_error) == "bad batch on rank(s) 1"


def test_strict_mismatch_after_accumulation_blocks_the_worker(batch):
    worker = make_worker()
    with pytest.raises(ParityError, match="sequence 6 of the shard"):
        worker.train_step(nudged(batch, 6))
    assert worker.global_step == 0
    with pytest.raises(
        RuntimeError, match="unusable: an earlier call raised ParityError and gradients were"
    ):
        worker.train_step(batch)


# ------------------------------------------------------------------ invariance off, parity modes


def test_invariance_off_reports_mismatch_and_truncates_the_importance_ratio():
    """fp32: about 20% of tokens differ without invariance (tiny bf16 models happen to match anyway)."""
    config = cell_config(
        0,
        1,
        "float32",
        model="tiny-llama",
        batch_invariant=False,
        parity="report",
        algorithm={"rollout_correction": "token_truncate"},
    )
    off_batch = to_batch(generate(rollout_engine(config), config, seed=5))
    worker = DeepSpeedTrainingWorker(config, device="cpu")
    metrics = worker.train_step(off_batch)
    assert metrics["parity/exact_match_fraction"] < 1.0 and metrics["parity/max_abs_diff"] > 0.0
    assert metrics["parity/num_tokens"] == off_batch.num_tokens
    assert all(torch.isfinite(torch.tensor(float(v))) for v in metrics.values())
    assert metrics["correction/ratio_min"] < 1.0 < metrics["correction/ratio_max"] < 2.0
    worker.config = dataclasses.replace(config, parity="off")
    assert not any(k.startswith("parity/") for k in worker.train_step(off_batch))


# ------------------------------------------------------------------ loss normalisation over micro-batches


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_loss_is_the_full_batch_loss(aggregation, batch):
    """Micro-batches of unequal token counts + DeepSpeed's 1/GA scaling still give the full-batch loss."""
    worker = make_worker(algorithm={"kl_coef": 0.0, "loss_aggregation": aggregation})
    metrics = worker.train_step(batch)
    # On-policy and bitwise equal: the trainer's logprobs ARE the rollout's, so the ratio is exactly 1.
    expected, _ = policy_loss(
        batch.rollout_logprobs,
        batch.rollout_logprobs,
        batch.advantages,
        batch.response_mask,
        aggregation=aggregation,
    )
    assert metrics["policy_loss"] == pytest.approx(float(expected), rel=1e-6, abs=1e-7)
    assert metrics["loss"] == pytest.approx(metrics["policy_loss"], rel=1e-6, abs=1e-7)
    assert metrics["entropy"] == pytest.approx(
        -float(batch.rollout_logprobs[batch.response_mask].mean()), rel=1e-6
    )


@pytest.mark.slow
def test_zero3_untied_lm_head_qwen2():
    """Qwen2: untied LM head (used ONLY by the wrapper's forward) under ZeRO-3, parity then one step."""
    config = cell_config(3, 1, "float32", model="tiny-qwen2")
    qwen_batch = to_batch(generate(rollout_engine(config), config, seed=5))
    worker = DeepSpeedTrainingWorker(config, device="cpu")
    assert worker.module.head_parameters()[0].numel() == 0, (
        "ZeRO-3 should partition the untied LM head"
    )
    mask = qwen_batch.response_mask
    assert torch.equal(worker.compute_logprobs(qwen_batch)[mask], qwen_batch.rollout_logprobs[mask])
    metrics = worker.train_step(qwen_batch)
    assert metrics["parity/exact_match_fraction"] == 1.0 and metrics["grad_norm"] > 0
    exported = worker.export_weights()
    assert exported["lm_head.weight"].shape == (1031, 128)
    assert exported["lm_head.weight"] is not exported["model.embed_tokens.weight"]  # untied


def test_sequences_per_step_must_fill_the_micro_batches():
    with pytest.raises(
        ValueError, match="multiple of trainer.micro_batch_size x trainer.num_ranks = 3 x 1"
    ):
        make_worker(trainer={"micro_batch_size": 3})


# ------------------------------------------------------------------ temperature, versions, model objects


def test_greedy_batch_is_scored_at_its_own_temperature(worker):
    """Greedy rollouts record T = 1 logprobs; the config says 0.9: the batch's T wins, bit for bit."""
    config = cell_config(0, 1, "float32", rollout={"temperature": 0.0})
    completions = generate(rollout_engine(config), config, seed=5)
    assert {c.logprob_temperature for c in completions} == {1.0}
    greedy = to_batch(completions)
    assert torch.equal(
        worker.compute_logprobs(greedy)[greedy.response_mask],
        greedy.rollout_logprobs[greedy.response_mask],
    )


def test_stale_batch_is_a_batch_error_naming_both_versions(worker, batch):
    with pytest.raises(
        BatchError, match="sampled by weight_version 5 but the worker's weights are version 0"
    ):
        worker.train_step(dataclasses.replace(batch, weight_version=5))


def test_weight_version_counts_updates_and_is_checkpointed(batch, tmp_path):
    worker = make_worker()
    assert worker.train_step(batch)["weight_version"] == worker.weight_version == 1
    worker.save_checkpoint(tmp_path / "ckpt")
    resumed = make_worker()
    resumed.load_checkpoint(tmp_path / "ckpt")
    assert resumed.weight_version == 1
    with pytest.raises(BatchError, match="stale batch"):
        resumed.train_step(batch)  # sampled by version 0; strict parity


def test_worker_trains_a_given_model_object(batch):
    """The module passed in is the one trained (patched in place); the KL reference is a frozen copy."""
    config = cell_config(0, 1, "float32")
    model, _ = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
    worker = DeepSpeedTrainingWorker(config, device="cpu", model=model)
    assert worker.module.policy is model and is_patched(model)
    assert worker.reference.policy is not model
    metrics = worker.train_step(batch)  # strict parity: same weights as the rollout's
    assert metrics["parity/exact_match_fraction"] == 1.0 and metrics["kl"] == 0.0
    assert torch.equal(model.lm_head.weight, worker.export_weights()["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, worker.reference.policy.lm_head.weight)
    with pytest.raises(
        ValueError, match=r"model parameters are \['torch.bfloat16'\] but dtype is 'float32'"
    ):
        DeepSpeedTrainingWorker(config, device="cpu", model=model.to(torch.bfloat16))
