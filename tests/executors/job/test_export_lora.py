"""A LoRA run's export: a PEFT adapter folder PEFT loads, and the merged HF folder.

Built straight from a perturbed LoRA policy's state dict (what the checkpoint's weights file
holds); the CLI path runs in test_lora_job.py.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from rl_engine.config import RunConfig
from rl_engine.executors.job.export_lora import ADAPTER_FILE, write_lora_export
from rl_engine.executors.worker.policy.setup import load_policy
from rl_engine.models import load_model
from tests.helpers.lora_policy import perturb_adapters

CONFIG = {"model": "tiny-llama", "dtype": "bfloat16", "seed": 3, "lora": {"rank": 4, "alpha": 8}}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(config, the policy's weights, adapter folder, merged folder)."""
    config = RunConfig.from_dict(CONFIG)
    policy, _ = load_policy(config)
    perturb_adapters(policy)
    weights = policy.state_dict()
    root = tmp_path_factory.mktemp("export_lora")
    write_lora_export(config, weights, root / "adapter", merged=False)
    write_lora_export(config, weights, root / "merged", merged=True)
    return config, weights, root / "adapter", root / "merged"


def _base(config):
    model, _ = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
    return model


def test_peft_loads_the_adapter_folder_with_the_trained_adapters(trained):
    from peft import PeftModel

    config, weights, adapter, _ = trained
    assert {p.name for p in adapter.iterdir()} == {"adapter_config.json", ADAPTER_FILE}
    loaded = PeftModel.from_pretrained(_base(config), adapter)
    adapters = {k: v for k, v in weights.items() if ".lora_" in k}
    assert len(adapters) == 28
    state = loaded.state_dict()
    for name, tensor in adapters.items():
        assert torch.equal(state[f"base_model.model.{name}"], tensor), name
    assert len(load_file(adapter / ADAPTER_FILE)) == len(adapters)


def test_merged_folder_targets_within_bf16_rounding_of_peft_and_the_rest_bitwise_the_base(trained):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config, _, adapter, merged = trained
    ours = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.bfloat16).state_dict()
    reference = PeftModel.from_pretrained(_base(config), adapter).merge_and_unload().state_dict()
    base = _base(config).state_dict()
    assert ours.keys() == base.keys() == reference.keys()
    targets = [k for k in base if k.endswith("_proj.weight")]
    assert len(targets) == 14
    for name in base:
        if name not in targets:
            assert torch.equal(ours[name], base[name]), name
            continue
        assert not torch.equal(ours[name], base[name]), name  # the adapter is folded in
        ref = reference[name].float()
        bound = 2**-7 * (ref.abs() + base[name].float().abs())  # a bf16 rounding of each term
        assert ((ours[name].float() - ref).abs() <= bound).all(), name
