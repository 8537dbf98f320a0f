"""The Hugging Face folders vLLM loads (rl_engine/rollout/vllm/folders.py): a tiny model saved
with vLLM's head size in the dtype asked, loading back as the same weights. Needs no vLLM."""

from __future__ import annotations

import torch

from rl_engine.models import load_model
from rl_engine.rollout.vllm.folders import VLLM_HEAD_DIM, write_folder


def test_a_tiny_folder_has_vllms_head_size_and_the_dtype(tmp_path):
    folder = write_folder("tiny-llama", torch.bfloat16, tmp_path)
    model, tokenizer = load_model(folder, dtype=torch.bfloat16)
    assert tokenizer is None
    assert model.config.head_dim == VLLM_HEAD_DIM
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    again, _ = load_model(write_folder("tiny-llama", torch.bfloat16, tmp_path / "again"))
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b.to(a.dtype)), name  # seed 0: the same weights each time
