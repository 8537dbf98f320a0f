"""The guard every op shares (common/op.py): the device check, the dtype gate, and the opt-in twin.

Checked: a `Serving` refuses a non-floating dtype and a refusal without saying what runs
instead; its guard checks the device first, always (the opt-in never skips it), then refuses
a dtype outside `invariant_dtypes` (NonInvariantDtypeError naming the op, backend, dtype, what
would run and the opt-in) and a dtype the platform check refuses (PlatformInvarianceError with
its reason); the opt-in twin checks the device only. `define_op` names both functions as the
backend's op and binds the flag into them (no global state): opting in once leaves the strict op
strict. Argument checks run before the gate: a refused dtype never hides a malformed call.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.kernels import NonInvariantDtypeError, PlatformInvarianceError, get_op
from rl_engine.kernels.common.op import Serving, define_op, opt_in_hint, opted_in

MODULE = "tests.kernels.common.test_op"


def _randn(*shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def _no_meta(name, t):
    if t.device.type == "meta":
        raise ValueError(f"{name} is on meta")


def _identity_op(serving: Serving):
    def build(guard):
        def op(x):
            guard("x", x)
            return x

        return op

    return define_op("identity", MODULE, serving, build)


def test_a_serving_names_what_it_cannot_promise():
    with pytest.raises(
        ValueError, match=r"invariant_dtypes must be floating dtypes, got \[torch.int64\]"
    ):
        Serving(backend="b", invariant_dtypes=(torch.float32, torch.int64), otherwise="x")
    with pytest.raises(ValueError, match="a Serving that refuses a dtype must say what would run"):
        Serving(backend="b", invariant_dtypes=(torch.float32,))
    Serving(backend="b")  # serves every floating dtype: nothing else to say


def test_the_strict_guard_refuses_by_name_and_its_twin_runs():
    serving = Serving(backend="b", invariant_dtypes=(torch.float32,), otherwise="a torch GEMM")
    strict = _identity_op(serving)
    assert strict.__name__ == "identity" and strict.__module__ == MODULE
    x = torch.ones(2, dtype=torch.bfloat16)
    with pytest.raises(NonInvariantDtypeError) as err:
        strict(x)
    message = str(err.value)
    assert message.startswith("op 'identity' of backend 'b' is not row-invariant for bfloat16")
    assert "it serves float32 invariantly; bfloat16 would run a torch GEMM" in message
    assert message.endswith(opt_in_hint("identity"))
    twin = opted_in(strict)
    assert twin is not strict and opted_in(twin) is twin and twin.__name__ == "identity"
    assert twin(x) is x
    assert strict(torch.ones(2)) is not None


def test_a_platform_refusal_is_raised_with_its_reason_and_the_opt_in():
    seen = []

    def refusal(dtype, device_type):
        seen.append((dtype, device_type))
        return "measured: no" if dtype == torch.float32 else None

    strict = _identity_op(Serving(backend="b", platform_refusal=refusal))
    with pytest.raises(PlatformInvarianceError, match="measured: no Or pass allow_non_invariant"):
        strict(torch.ones(2))
    strict(torch.ones(2, dtype=torch.float64))
    opted_in(strict)(torch.ones(2))  # the twin never asks the platform
    assert seen == [(torch.float32, "cpu"), (torch.float64, "cpu")]


def test_the_device_check_runs_before_the_gate_strict_or_not():
    strict = _identity_op(
        Serving(
            backend="b", invariant_dtypes=(torch.float32,), otherwise="y", check_device=_no_meta
        )
    )
    x = torch.ones(2, dtype=torch.bfloat16, device="meta")
    for op in (strict, opted_in(strict)):
        with pytest.raises(ValueError, match="x is on meta") as err:
            op(x)
        assert not isinstance(err.value, NonInvariantDtypeError)


def test_opted_in_names_a_function_define_op_did_not_build():
    with pytest.raises(RuntimeError, match=r"\.torch_sum was not built by common.op.define_op"):

        def torch_sum(x):
            return x.sum()

        opted_in(torch_sum)


def test_the_opt_in_travels_with_the_function_not_with_global_state():
    """Opting in once changes nothing for the strict op held elsewhere (no global switch)."""
    x, w = _randn(3, 8, dtype=torch.float64, seed=0), _randn(4, 8, dtype=torch.float64, seed=1)
    strict = get_op("linear", "cpu")
    opted_in_linear = get_op("linear", "cpu", allow_non_invariant=True)
    assert opted_in_linear is not strict and opted_in_linear.__module__ == strict.__module__
    assert get_op("linear", "cpu", allow_non_invariant=True) is opted_in_linear
    opted_in_linear(x, w)
    with pytest.raises(NonInvariantDtypeError, match="op 'linear' of backend 'cpp'"):
        strict(x, w)
    assert get_op("linear", "cpu") is strict


def test_bad_inputs_keep_their_own_errors_before_the_dtype_gate():
    """Argument checks run first: a refused dtype never hides a malformed call."""
    w = torch.zeros(4, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match="x has last dim 7") as err:
        get_op("linear", "cpu")(torch.zeros(2, 7, dtype=torch.float64), w)
    assert not isinstance(err.value, NonInvariantDtypeError)


def test_the_opt_in_never_skips_the_device_check():
    """cpp ops take cpu tensors only (a tensor elsewhere used to run another backend's op)."""
    x, w = torch.zeros(2, 8, device="meta"), torch.zeros(4, 8, device="meta")
    for allow in (False, True):
        with pytest.raises(ValueError, match="x is on meta: the cpp backend runs on cpu"):
            get_op("linear", "cpu", allow_non_invariant=allow)(x, w)
