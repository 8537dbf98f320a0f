"""The input checks every backend shares (common/checks.py): each error names the tensor and the value.

Checked: `at_least_fp32` keeps fp64 (gradcheck) and lifts 16-bit floats to fp32; each check
accepts a good input and raises the documented type (TypeError for a type or dtype, ValueError
for a shape or a value) with a message naming the tensor, the bad value and what was expected;
`check_index_range` lets the `ignore` value through and skips empty ids.
"""

import math

import pytest
import torch

from rl_engine.kernels.common.checks import (
    FLOAT_DTYPES,
    at_least_fp32,
    check_embedding,
    check_floating,
    check_index_range,
    check_last_dim,
    check_projection,
    check_same_dtype,
    check_temperature,
)


def test_at_least_fp32():
    assert [at_least_fp32(d) for d in FLOAT_DTYPES] == [
        torch.float32,
        torch.float32,
        torch.float32,
        torch.float64,
    ]


def test_check_floating_names_the_tensor_and_its_type_or_dtype():
    for dtype in FLOAT_DTYPES:
        check_floating("h", torch.zeros(1, dtype=dtype))
    with pytest.raises(TypeError, match="h must be a torch.Tensor, got ndarray"):
        check_floating("h", torch.zeros(1).numpy())
    with pytest.raises(TypeError, match="h must be a floating-point tensor, got dtype torch.int32"):
        check_floating("h", torch.zeros(1, dtype=torch.int32))


def test_check_last_dim_and_same_dtype():
    check_last_dim("x", torch.zeros(2, 5), 5, "weight's in_features")
    with pytest.raises(
        ValueError, match=r"x has last dim 4 but weight's in_features is 5 \(shape \(2, 4\)\)"
    ):
        check_last_dim("x", torch.zeros(2, 4), 5, "weight's in_features")
    with pytest.raises(TypeError, match="a is torch.float16 but b is torch.float32; cast one"):
        check_same_dtype("a", torch.zeros(1, dtype=torch.float16), "b", torch.zeros(1))


def test_check_projection():
    x, w = torch.zeros(3, 4, 8), torch.zeros(5, 8)
    check_projection("x", x, w, torch.zeros(5))
    check_projection("x", x, w, None)
    with pytest.raises(ValueError, match=r"weight must be 2-D .* got shape \(5, 8, 1\)"):
        check_projection("x", x, w[..., None], None)
    with pytest.raises(TypeError, match="weight must be a floating-point tensor"):
        check_projection("x", x, w.long(), None)
    with pytest.raises(ValueError, match=r"bias must have shape \(5,\), got \(4,\)"):
        check_projection("x", x, w, torch.zeros(4))


def test_check_index_range_names_min_max_and_the_allowed_range():
    check_index_range("ids", torch.tensor([0, 9]), 10, "the vocabulary size")
    check_index_range("ids", torch.zeros(0, dtype=torch.long), 10, "the vocabulary size")
    check_index_range("t", torch.tensor([-100, 3]), 10, "the vocabulary", ignore=-100)
    check_index_range("t", torch.tensor([-100, -100]), 10, "the vocabulary", ignore=-100)
    with pytest.raises(
        ValueError,
        match=r"t out of range: min -1, max 3, but the vocabulary is 10 \(allowed \[0, 9\] or -100\)",
    ):
        check_index_range("t", torch.tensor([-100, -1, 3]), 10, "the vocabulary", ignore=-100)
    with pytest.raises(TypeError, match="ids must be an integer tensor, got dtype torch.float32"):
        check_index_range("ids", torch.tensor([1.0]), 10, "the vocabulary size")


def test_check_embedding():
    check_embedding(torch.tensor([[0, 3]]), torch.zeros(4, 2))
    with pytest.raises(
        ValueError, match=r"embedding weight must be 2-D \(vocab, hidden\), got \(4,\)"
    ):
        check_embedding(torch.tensor([0]), torch.zeros(4))
    with pytest.raises(
        ValueError, match="token ids out of range: min 0, max 4, but the vocabulary"
    ):
        check_embedding(torch.tensor([0, 4]), torch.zeros(4, 2))


def test_check_temperature():
    assert check_temperature(1) == 1.0 and isinstance(check_temperature(1), float)
    for bad in (0, -0.5, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature must be a finite number > 0, got"):
            check_temperature(bad)
