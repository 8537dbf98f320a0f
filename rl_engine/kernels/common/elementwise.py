"""The elementwise ops (`silu`, `sigmoid`), written once: x -> f(x) computed in fp32, in x.dtype.

The backend supplies `forward(x)` (differentiable) for each; the check is here.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import check_floating
from rl_engine.kernels.common.op import Serving, define_op

_FORMULAS = {"silu": "x / (1 + exp(-x))", "sigmoid": "1 / (1 + exp(-x))"}


def elementwise_op(name: str, forward, serving: Serving, module: str):
    """The public elementwise op `name` (silu or sigmoid) of the backend `module`."""
    if name not in _FORMULAS:
        raise ValueError(f"unknown elementwise op {name!r}; known: {', '.join(_FORMULAS)}")

    def build(guard):
        def op(x: torch.Tensor) -> torch.Tensor:
            check_floating("x", x)
            guard("x", x)
            return forward(x)

        op.__doc__ = f"Elementwise {name}, {_FORMULAS[name]} in fp32, returned in x.dtype."
        return op

    return define_op(name, module, serving, build)
