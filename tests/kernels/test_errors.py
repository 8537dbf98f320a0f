"""The kernels' errors (kernels/errors.py): one type to catch for a refused dtype, and the types
callers caught before still catch it.

Checked: NonInvariantDtypeError is a ValueError; PlatformInvarianceError (native's measured
refusal) is a NonInvariantDtypeError and a RuntimeError; a real refusal (cpp's fp64 linear)
is caught as either name and says what to do.
"""

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.errors import NonInvariantDtypeError, PlatformInvarianceError


def test_the_error_types():
    """One name to catch: a measured refusal (native's probe) is a NonInvariantDtypeError too,
    and both stay what callers caught before (ValueError; PlatformInvarianceError a RuntimeError)."""
    assert issubclass(NonInvariantDtypeError, ValueError)
    assert issubclass(PlatformInvarianceError, NonInvariantDtypeError)
    assert issubclass(PlatformInvarianceError, RuntimeError)


def test_a_refusal_is_caught_as_a_value_error_and_names_the_way_out():
    x, w = torch.zeros(2, 8, dtype=torch.float64), torch.zeros(3, 8, dtype=torch.float64)
    with pytest.raises(ValueError) as err:
        get_op("linear", "cpu", backend="cpp")(x, w)
    assert type(err.value) is NonInvariantDtypeError
    assert "op 'linear' of backend 'cpp' is not row-invariant for float64" in str(err.value)
    assert "allow_non_invariant=True" in str(err.value)
