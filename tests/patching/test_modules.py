"""The drop-in modules the patch installs (patching/modules.py).

What it checks: each module keeps the original Parameter objects (optimizers and tied weights
keep working) and calls the op it was given with them: an `InvariantLinear` == calling its op
on the same weight and bias, torch.equal; an `InvariantEmbedding` looks ids up with the
padding index and keeps a scaled embedding's scale; an `InvariantRMSNorm` takes the base's
variance_epsilon (or eps); a module whose parameters or input left the patched device type
refuses to run, naming the module, the device it was patched for and the backend.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from rl_engine.kernels import get_op
from rl_engine.patching.modules import (
    InvariantEmbedding,
    InvariantLinear,
    InvariantLMHead,
    InvariantRMSNorm,
    InvariantSiLU,
)


def test_a_linear_keeps_its_parameters_and_calls_its_op_with_them():
    base, op = nn.Linear(6, 4), get_op("linear", "cpu")
    linear = InvariantLinear(base, op, "cpp", "cpu")
    assert linear.weight is base.weight and linear.bias is base.bias
    x = torch.randn(3, 6)
    with torch.no_grad():
        assert torch.equal(linear(x), op(x, base.weight, base.bias))
    assert "in_features=6, out_features=4, bias=True, backend=cpp" in repr(linear)
    assert "vocab=4, fp32_logits=True" in repr(InvariantLMHead(base, op, "cpp", "cpu"))


def test_an_embedding_looks_ids_up_and_keeps_a_scale():
    base = nn.Embedding(10, 4, padding_idx=0)
    base.embed_scale = torch.tensor(2.0)
    embedding = InvariantEmbedding(base, get_op("embedding", "cpu"), "cpp", "cpu")
    assert embedding.weight is base.weight and embedding.padding_idx == 0
    ids = torch.tensor([[1, 0, 9]])
    with torch.no_grad():
        assert torch.equal(embedding(ids), base.weight[ids] * 2.0)


def test_a_norm_takes_the_bases_epsilon():
    base = nn.Module()
    base.weight, base.variance_epsilon = nn.Parameter(torch.ones(4)), 1e-3
    assert InvariantRMSNorm(base, get_op("rms_norm", "cpu"), "cpp", "cpu").eps == 1e-3
    del base.variance_epsilon
    base.eps = 1e-5
    assert InvariantRMSNorm(base, get_op("rms_norm", "cpu"), "cpp", "cpu").eps == 1e-5


def test_a_module_off_its_patched_device_type_refuses_to_run():
    linear = InvariantLinear(nn.Linear(2, 2), get_op("linear", "cpu"), "cpp", "cpu")
    linear.to("meta")
    with pytest.raises(
        RuntimeError,
        match=r"InvariantLinear: the model was patched for 'cpu' \(backend 'cpp'\) but now runs on meta",
    ):
        linear(torch.zeros(1, 2, device="meta"))
    silu = InvariantSiLU(get_op("silu", "cpu"), "cpp", "cpu")
    with pytest.raises(RuntimeError, match="InvariantSiLU: the model was patched for 'cpu'"):
        silu(torch.zeros(2, device="meta"))
