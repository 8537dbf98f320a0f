"""An exception in the middle of a worker call: what it leaves behind, and whether to go on.

Under ZeRO-3 DeepSpeed gathers a module's parameters for its forward and releases them after
it; an exception in between leaves them gathered, so they are released here. Once a backward
has run, its gradients sit inside DeepSpeed's buffers, which no public call clears: the
worker then refuses further calls, and a new worker (with `load_checkpoint`) continues.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from rl_engine.executors.worker.policy.setup import release_zero3_parameters


class MidStepFailures:
    """Watches a worker's calls (`recoverable`) and keeps the reason it became unusable."""

    def __init__(self, engine, zero3: bool):
        self.engine, self.zero3 = engine, zero3
        self.unusable: str | None = None
        self.backward_taken = False
        """Set by the caller once a backward ran inside the current `recoverable` block."""

    @contextmanager
    def recoverable(self) -> Iterator[None]:
        """On an exception: release ZeRO-3 parameters; after a backward, refuse further calls."""
        self.backward_taken = False
        try:
            yield
        except BaseException as err:
            reason = None
            if self.zero3:
                try:
                    release_zero3_parameters(self.engine)
                except Exception as release_err:  # pragma: no cover - DeepSpeed internals
                    reason = f"its ZeRO-3 parameters could not be released ({release_err})"
            if self.backward_taken:
                reason = reason or "gradients were already accumulated inside DeepSpeed"
            if reason is not None:
                self.unusable = f"an earlier call raised {type(err).__name__} and {reason}"
            raise

    def require_usable(self) -> None:
        if self.unusable is not None:
            raise RuntimeError(
                f"this worker is unusable: {self.unusable}; build a new worker "
                "(and load_checkpoint) to continue"
            )
