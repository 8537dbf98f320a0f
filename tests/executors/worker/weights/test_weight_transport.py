"""The sending side's pure helpers (executors/worker/weights/weight_transport.py), on a small
module built in code: tied tensors are sent once under all their names; without ZeRO-3 the W
ranks' ranges split each tensor evenly and, concatenated in rank order, are the tensor, bit for
bit; adapters are picked by name; a group the plans do not fill is named."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.weights.weight_transport import (
    adapter_names,
    agree_on_group,
    full_shape,
    held_ranges,
    policy_manifest,
    policy_tensors,
)


def tied_model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(5, 3)
    model.head = nn.Linear(3, 5, bias=False)
    model.head.weight = model.embed.weight  # tied, as in many small LMs
    model.norm = nn.LayerNorm(3)
    return model


def test_tied_tensors_are_listed_once_with_all_names():
    names = [names for names, _ in policy_tensors(tied_model())]
    assert names == [("embed.weight", "head.weight"), ("norm.weight",), ("norm.bias",)]


def test_even_ranges_concatenate_to_each_tensor():
    model = tied_model()
    manifest = policy_manifest(model, zero3=False, world_size=2)
    spec = manifest.tensors[0]
    assert (spec.name, spec.shape, spec.aliases) == ("embed.weight", (5, 3), ("head.weight",))
    assert full_shape(model.embed.weight) == (5, 3)
    ranges = [held_ranges(model, manifest, rank, zero3=False) for rank in (0, 1)]
    for index, (_, tensor) in enumerate(policy_tensors(model)):
        lo, hi = manifest.tensors[index].sources[0]
        assert lo == 0 and abs((hi - lo) * 2 - tensor.numel()) <= 1  # near-even
        joined = torch.cat([ranges[0][index], ranges[1][index]])
        assert torch.equal(joined, tensor.detach().reshape(-1))
    ranges[0][0][0] = 42.0  # a view, not a copy: the rank sends what it holds
    assert model.embed.weight[0, 0] == 42.0


def test_adapter_names_and_a_group_the_plans_do_not_fill():
    model = tied_model()
    model.head.lora_A = nn.ModuleDict({"default": nn.Linear(3, 1, bias=False)})  # PEFT's naming
    manifest = policy_manifest(model, zero3=False, world_size=1)
    assert adapter_names(manifest) == ["head.lora_A.default.weight"]
    with pytest.raises(
        ValueError, match="0 receiver plans for a weight group of 3 with 1 trainer ranks"
    ):
        agree_on_group(manifest, [], 3, Collectives(0, 1, torch.device("cpu")))
    agree_on_group(manifest, [], 1, Collectives(0, 1, torch.device("cpu")))  # control: filled
