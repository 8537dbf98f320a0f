"""Batch-invariant tensor ops, looked up per device through the registry.

Only torch (and triton, in the triton backend) is imported below this package.
Code outside this package never imports a backend: it asks `get_op` (and
`backend_layout` for layout facts) with the device it runs on.
"""

from rl_engine.kernels.common.cpu_flags import cpu_flags
from rl_engine.kernels.common.sequence_spans import GradientSink, SequenceSpans
from rl_engine.kernels.errors import NonInvariantDtypeError, PlatformInvarianceError
from rl_engine.kernels.facts import kernel_facts
from rl_engine.kernels.registry import (
    OP_NAMES,
    BackendLayout,
    OpImpl,
    WeightPacking,
    backend_layout,
    get_op,
    interpreter_enabled,
    list_backends,
    list_ops,
    resolve_backend,
)

__all__ = [
    "OP_NAMES",
    "BackendLayout",
    "GradientSink",
    "NonInvariantDtypeError",
    "OpImpl",
    "PlatformInvarianceError",
    "SequenceSpans",
    "WeightPacking",
    "backend_layout",
    "cpu_flags",
    "get_op",
    "interpreter_enabled",
    "kernel_facts",
    "list_backends",
    "list_ops",
    "resolve_backend",
]
