"""The cpp moe_experts (cpp/moe_experts.py): every expert in one C++ call, with the composition's bits.

Chain: `experts_forward` (csrc/moe_impl.h) == the per-expert composition of the cpp `linear`
and `silu` (common/moe_experts.py, `composed_forward`), output and the tensors it keeps for
the backward, torch.equal, fp32 and bf16; a token alone == the same token in the batch;
fp64 (opted in) is the composition itself. Negative control: the same composition of plain
F.linear and F.silu gives other bits. Across backends and against HF: tests/kernels/common/test_moe_experts.py.
"""

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import NonInvariantDtypeError, get_op
from rl_engine.kernels.common.moe_experts import composed_forward
from rl_engine.kernels.cpp.moe_experts import experts_forward, moe_experts

EXPERTS, HIDDEN, WIDTH, TOP_K = 4, 64, 48, 2


def _case(tokens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, HIDDEN, generator=g).to(dtype)
    gate_up = (torch.randn(EXPERTS, 2 * WIDTH, HIDDEN, generator=g) / 8).to(dtype)
    down = (torch.randn(EXPERTS, HIDDEN, WIDTH, generator=g) / 7).to(dtype)
    indices = torch.stack([torch.randperm(EXPERTS, generator=g)[:TOP_K] for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=g).to(dtype)
    return hidden, gate_up, down, indices, weights


def _composed_cpp(allow_non_invariant=False):
    linear = get_op("linear", "cpu", allow_non_invariant=allow_non_invariant)
    return composed_forward(linear, get_op("silu", "cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_call_has_the_bits_of_the_composition_and_keeps_the_same_tensors(dtype):
    args = _case(40, dtype)
    out, (grouping, gate_up_out, down_out) = experts_forward(*args, keep=True)
    want, (want_grouping, want_gate_up, want_down) = _composed_cpp()(*args, True)
    assert out.dtype == dtype and torch.equal(out, want)
    assert torch.equal(gate_up_out, want_gate_up) and torch.equal(down_out, want_down)
    assert torch.equal(grouping.order, want_grouping.order)
    assert experts_forward(*args, keep=False)[1] is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_token_alone_has_its_bits_in_the_batch(dtype):
    hidden, gate_up, down, indices, weights = _case(40, dtype)
    full = moe_experts(hidden, gate_up, down, indices, weights)
    for t in (0, 17, 39):
        alone = moe_experts(
            hidden[t : t + 1], gate_up, down, indices[t : t + 1], weights[t : t + 1]
        )
        assert torch.equal(alone[0], full[t]), t


def test_negative_control_plain_torch_composition_gives_other_bits():
    args = _case(40, torch.float32)
    plain = composed_forward(F.linear, F.silu)(*args, False)[0]
    assert not torch.equal(plain, experts_forward(*args, keep=False)[0])


def test_fp64_is_refused_unless_opted_in_and_then_is_the_composition():
    args = _case(10, torch.float64)
    with pytest.raises(NonInvariantDtypeError, match="'moe_experts' of backend 'cpp'.*float64"):
        moe_experts(*args)
    opted_in = get_op("moe_experts", "cpu", allow_non_invariant=True)
    assert torch.equal(opted_in(*args), _composed_cpp(allow_non_invariant=True)(*args, False)[0])


def test_bad_shapes_are_named():
    hidden, gate_up, down, indices, weights = _case(5, torch.float32)
    with pytest.raises(ValueError, match="gate_up must be \\(num_experts, 2 \\* intermediate"):
        moe_experts(hidden, gate_up[:, :, :10], down, indices, weights)
    with pytest.raises(ValueError, match="hidden must be 2-D"):
        moe_experts(hidden[None], gate_up, down, indices, weights)
