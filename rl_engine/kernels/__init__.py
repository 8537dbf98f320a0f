"""Batch-invariant tensor ops, looked up per device through the registry.

Only torch (and triton, in the triton backend) is imported below this package.
"""

from rl_engine.kernels.facts import kernel_facts
from rl_engine.kernels.registry import OP_NAMES, OpImpl, get_op, list_backends, list_ops

__all__ = ["OP_NAMES", "OpImpl", "get_op", "kernel_facts", "list_backends", "list_ops"]
