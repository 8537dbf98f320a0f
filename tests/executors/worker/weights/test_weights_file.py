"""The streamed weights file: a safetensors file whose tied names come back as one tensor."""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.weights.weights_file import (
    WeightsFileWriter,
    read_weights_file,
    save_state_dict,
)


def test_round_trip_is_bitwise_and_keeps_tied_names_tied(tmp_path):
    from safetensors.torch import load_file

    embed = torch.randn(7, 3).to(torch.bfloat16)
    state = {
        "model.embed_tokens.weight": embed,
        "model.norm.weight": torch.randn(3),
        "model.empty": torch.zeros(0, 4),
        "lm_head.weight": embed,  # tied: the same tensor
        "step": torch.tensor([5], dtype=torch.int64),
    }
    path = save_state_dict(tmp_path / "weights.safetensors", state)
    back = read_weights_file(path)
    assert back.keys() == state.keys()
    for name, tensor in state.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name
    assert back["lm_head.weight"] is back["model.embed_tokens.weight"]
    plain = load_file(path)  # a standard safetensors file, the alias stored once
    assert "lm_head.weight" not in plain and torch.equal(plain["model.embed_tokens.weight"], embed)
    assert not list(tmp_path.glob(".*.tmp"))


def test_a_wrong_tensor_or_a_missing_one_leaves_no_file(tmp_path):
    entries = [(("a",), (2, 2), torch.float32), (("b",), (3,), torch.float32)]
    writer = WeightsFileWriter(tmp_path / "w.safetensors", entries)
    with pytest.raises(
        ValueError, match=r"'a': got \(4,\) torch.float32, the header says \(2, 2\)"
    ):
        writer.write(torch.zeros(4))
    writer.write(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="'b' was never written"):
        writer.close()
    assert list(tmp_path.iterdir()) == []
