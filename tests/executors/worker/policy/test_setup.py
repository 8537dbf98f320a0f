"""The policy a worker trains, before DeepSpeed wraps it (executors/worker/policy/setup.py), on
the tiny Llama in-process: loaded from the run's seed (the same seed, the same weights; another,
others), given the `lora:` adapter (only its parameters train; a LoRA base is recorded by model
and hash), patched for the device; every mismatch between the model and the config (a
diagnostics adapter, a dtype, a patch without batch_invariant, an adapter with lora.rank 0) is
refused by name."""

from __future__ import annotations

import pytest
import torch

from rl_engine.config import RunConfig
from rl_engine.executors.worker.policy.setup import (
    base_record,
    load_policy,
    prepare_policy,
    with_lora,
)
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant, patch_handle

CPU = torch.device("cpu")


def _config(**fields) -> RunConfig:
    return RunConfig.from_dict({"model": "tiny-llama", **fields})


def _same_weights(a, b) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_the_policy_is_the_runs_seeds_model_patched_for_the_device():
    model, tokenizer = load_policy(_config(seed=5))
    assert tokenizer is None and patch_handle(model) is None  # unpatched, as loaded
    assert _same_weights(model, load_model("tiny-llama", seed=5)[0])
    assert not _same_weights(model, load_model("tiny-llama", seed=6)[0])  # control
    policy = prepare_policy(None, _config(seed=5), CPU)
    assert patch_handle(policy).device_type == "cpu"
    assert base_record(policy, _config()) is None  # no LoRA: no base to record


def test_a_lora_policy_trains_only_its_adapter_and_records_its_base():
    config = _config(lora={"rank": 4})
    policy = prepare_policy(None, config, CPU)
    trained = [n for n, p in policy.named_parameters() if p.requires_grad]
    assert trained and all("lora_" in n for n in trained)
    record = base_record(policy, config)
    assert record["model"] == "tiny-llama" and isinstance(record["hash"], str)
    assert with_lora(policy, config) is policy  # an adapter of the right shape is kept


def test_mismatches_between_model_and_config_are_refused():
    with pytest.raises(ValueError, match="adapter: 'some/folder' is read by `rl-engine diagnose"):
        prepare_policy(None, _config(adapter="some/folder"), CPU)
    model, _ = load_model("tiny-llama", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"model parameters are \['torch.bfloat16'\] but dtype"):
        prepare_policy(model, _config(), CPU)
    patched, _ = load_model("tiny-llama")
    apply_batch_invariant(patched)
    with pytest.raises(ValueError, match="patched .* but batch_invariant is false"):
        prepare_policy(patched, _config(batch_invariant=False, parity="off"), CPU)
    with pytest.raises(TypeError, match="must be a torch nn.Module, got str"):
        prepare_policy("tiny-llama", _config(), CPU)
    lora_policy, _ = load_policy(_config(lora={"rank": 4}))
    with pytest.raises(ValueError, match="carries LoRA adapters but lora.rank is 0"):
        with_lora(lora_policy, _config())
