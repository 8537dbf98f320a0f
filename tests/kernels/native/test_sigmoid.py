"""The native sigmoid (native/sigmoid.py): 1 / (1 + exp(-x)) in fp32, the same bits at any position.

Chain: an element computed alone == the same element inside a long tensor (SIMD body vs scalar
tail) == the autograd path's result; accurate against fp64 within fp32 rounding. Negative
control: torch's own torch.sigmoid gives an element alone other bits than inside a long tensor.
"""

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.native.sigmoid import sigmoid, sigmoid_forward
from tests.helpers.kernels.elementwise import (
    ACCURACY_DTYPES,
    alone_and_in_a_tensor,
    assert_accurate,
    assert_autograd_bits_equal_inference_bits,
    assert_gradcheck,
    values,
)


def test_an_element_alone_has_its_bits_inside_a_long_tensor():
    alone, inside = alone_and_in_a_tensor(sigmoid, values())
    assert torch.equal(alone, inside)


def test_negative_control_torch_sigmoid_depends_on_the_position():
    alone, inside = alone_and_in_a_tensor(torch.sigmoid, values())
    assert not torch.equal(alone, inside)


def test_the_autograd_path_has_the_bits_of_the_inference_path():
    assert_autograd_bits_equal_inference_bits(sigmoid_forward)


@pytest.mark.parametrize("dtype", ACCURACY_DTYPES)
def test_sigmoid_is_accurate_in_the_input_dtype(dtype):
    assert_accurate(sigmoid, torch.sigmoid, dtype)


def test_the_registry_serves_this_op_and_its_gradient_flows():
    assert get_op("sigmoid", "cpu", backend="native") is sigmoid
    assert_gradcheck(sigmoid)


def test_a_non_float_input_is_refused_by_name():
    with pytest.raises(TypeError, match="floating"):
        sigmoid(torch.arange(3))
