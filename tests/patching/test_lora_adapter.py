"""A PEFT adapter folder onto its base model (patching/lora_adapter.py), in one process.

Chain (torch.equal): a tiny-llama LoRA policy (A and B perturbed) written as a PEFT folder
(`adapter_files`: what `rl-engine export` writes), loaded onto a fresh base, holds the
policy's adapter tensors, frozen, and computes the policy's logits; negative control: the base
without it does not. Refusals name the file and what is wrong: not JSON, not LoRA, a patched
base, an adapter tensor missing from the file. (The CLI and the diagnosis with `--adapter`:
tests/diagnostics/test_rollout_adapter.py.)
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.patching.lora import adapter_files, is_adapter_name
from rl_engine.patching.lora_adapter import CONFIG_FILE, WEIGHTS_FILE, load_adapter
from tests.helpers.lora_policy import lora_model

IDS = torch.tensor([[5, 9, 14, 3, 77, 12]])


def _folder(tmp_path, policy):
    config, tensors = adapter_files(policy, "tiny-llama")
    folder = tmp_path / "adapter"
    folder.mkdir()
    save_file(tensors, folder / WEIGHTS_FILE, metadata={"format": "pt"})
    config.save_pretrained(folder)
    return folder, tensors


def _base():
    return load_model("tiny-llama", seed=0)[0]


def test_a_loaded_adapter_is_the_policys_frozen_and_computes_its_logits(tmp_path):
    policy = lora_model("tiny-llama")
    folder, _ = _folder(tmp_path, policy)
    model = load_adapter(_base(), folder)
    want = {k: v for k, v in policy.state_dict().items() if is_adapter_name(k)}
    got = {k: v for k, v in model.state_dict().items() if is_adapter_name(k)}
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not any(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        logits = policy(IDS).logits
        assert torch.equal(model(IDS).logits, logits)
        assert not torch.equal(_base()(IDS).logits, logits)


def test_a_config_that_is_not_json_or_not_lora_is_named(tmp_path):
    folder, _ = _folder(tmp_path, lora_model("tiny-llama"))
    config_file = folder / CONFIG_FILE
    fields = json.loads(config_file.read_text())
    config_file.write_text(json.dumps({**fields, "peft_type": "IA3"}))
    with pytest.raises(ValueError, match=rf"{config_file}: peft_type is 'IA3'; only a LoRA"):
        load_adapter(_base(), folder)
    config_file.write_text("{")
    with pytest.raises(ValueError, match=rf"{config_file}: not JSON"):
        load_adapter(_base(), folder)


def test_a_patched_base_or_a_missing_tensor_is_refused(tmp_path):
    folder, tensors = _folder(tmp_path, lora_model("tiny-llama"))
    patched = _base()
    apply_batch_invariant(patched)
    with pytest.raises(ValueError, match="onto the unpatched base model, without adapters"):
        load_adapter(patched, folder)
    dropped = sorted(tensors)[0]
    save_file({k: v for k, v in tensors.items() if k != dropped}, folder / WEIGHTS_FILE)
    with pytest.raises(
        ValueError,
        match=r"adapter_model.safetensors: does not fit this base model: 1 adapter tensor\(s\) missing",
    ):
        load_adapter(_base(), folder)
