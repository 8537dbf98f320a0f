"""What an exception in the middle of a worker call leaves (executors/worker/step/recovery.py):
before any backward the worker stays usable and the exception goes on; after a backward (or
when ZeRO-3's gathered parameters cannot be released) every later call is refused with an error
that names the first exception and the reason. The control: a call that raises nothing leaves
the worker usable."""

from __future__ import annotations

import pytest

from rl_engine.executors.worker.step.recovery import MidStepFailures


def test_a_call_that_raises_nothing_leaves_the_worker_usable():
    failures = MidStepFailures(engine=None, zero3=False)
    with failures.recoverable():
        failures.backward_taken = True
    failures.require_usable()
    assert failures.unusable is None


def test_an_exception_before_the_backward_is_raised_and_the_worker_goes_on():
    failures = MidStepFailures(engine=None, zero3=False)
    with pytest.raises(ValueError, match="bad batch"), failures.recoverable():
        raise ValueError("bad batch")
    failures.require_usable()


def test_an_exception_after_the_backward_makes_the_worker_refuse_every_call():
    failures = MidStepFailures(engine=None, zero3=False)
    with pytest.raises(KeyError), failures.recoverable():
        failures.backward_taken = True
        raise KeyError("lost")
    message = (
        "this worker is unusable: an earlier call raised KeyError and gradients were already "
        "accumulated inside DeepSpeed; build a new worker (and load_checkpoint) to continue"
    )
    with pytest.raises(RuntimeError) as refused:
        failures.require_usable()
    assert str(refused.value) == message
    # the next block starts without a backward, but the reason stays
    with failures.recoverable():
        pass
    with pytest.raises(RuntimeError, match="unusable"):
        failures.require_usable()


def test_zero3_parameters_that_cannot_be_released_make_the_worker_unusable():
    failures = MidStepFailures(engine=None, zero3=True)  # no engine: nothing to release
    with pytest.raises(ValueError, match="in the forward"), failures.recoverable():
        raise ValueError("in the forward")
    with pytest.raises(RuntimeError, match="its ZeRO-3 parameters could not be released"):
        failures.require_usable()
