"""Each TP rank reads only its rows of a safetensors file (rollout/tp/load.py).

In one process, a group of one rank that calls itself rank 1 of 2 (reading needs no
collective): `safetensors_files` finds a file, a folder's files or its index's shards, and
names a path that is missing or holds none; `read_shards` gives every state-dict name of the
sharded model its value (torch.equal to the full tensor's rows for a sharded name, the whole
tensor else), reads fewer bytes than the file holds, and names a tensor the file lacks.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from rl_engine.rollout.tp import ShardGroup, shard_model
from rl_engine.rollout.tp.load import INDEX_FILE, read_shards, safetensors_files
from rl_engine.rollout.tp.shard import shard_rows
from tests.helpers.rollout.common import fresh_model

Q = "model.layers.0.self_attn.q_proj.weight"


def _full_and_rank_one(tmp_path):
    model = fresh_model("tiny-llama")
    full = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    group = ShardGroup()
    group.rank, group.world = 1, 2
    shard_model(model, group)
    return model, full


def test_a_rank_reads_its_rows_and_replicated_tensors_whole(tmp_path, one_rank_group):
    model, full = _full_and_rank_one(tmp_path)
    save_file(full, tmp_path / "model.safetensors")
    values, read = read_shards(model, tmp_path)
    assert set(values) == set(model.state_dict())
    rows = shard_rows(model)
    for name, value in values.items():
        start, stop = rows.get(name, (0, full[name].shape[0] if full[name].dim() else 0))
        want = full[name][start:stop] if name in rows else full[name]
        assert torch.equal(value, want), name
    assert read < sum(t.numel() * t.element_size() for t in full.values())
    del full[Q]
    save_file(full, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=f"have no tensor '{Q}'"):
        read_shards(model, tmp_path)


def test_the_files_of_a_path(tmp_path):
    single = tmp_path / "weights.safetensors"
    save_file({"a": torch.zeros(1)}, single)
    assert safetensors_files(single) == [single]
    folder = tmp_path / "hf"
    folder.mkdir()
    for name in ("b.safetensors", "a.safetensors"):
        save_file({"a": torch.zeros(1)}, folder / name)
    assert safetensors_files(folder) == [folder / "a.safetensors", folder / "b.safetensors"]
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "b.safetensors"}}))
    assert safetensors_files(folder) == [folder / "b.safetensors"]
    with pytest.raises(FileNotFoundError, match="does not exist"):
        safetensors_files(tmp_path / "nowhere")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="has no .safetensors file"):
        safetensors_files(empty)
