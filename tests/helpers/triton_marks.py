"""Where the Triton tests run and how they are marked: one definition for every Triton test file.

On a machine with a GPU they run the compiled kernels on cuda; without one, on CPU
tensors under Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1 first).
"""

import pytest
import torch

from rl_engine.kernels import interpreter_enabled

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

TRITON_MARKS = [
    pytest.mark.triton,
    pytest.mark.skipif(
        DEVICE == "cpu" and not interpreter_enabled(),
        reason="no GPU and TRITON_INTERPRET is not set",
    ),
]


def dtypes_keeping(kept: torch.dtype, dtypes=(torch.float32, torch.bfloat16)) -> list:
    """`dtypes` as parameters where only `kept` runs in `make test`: the interpreter takes 5-20 s
    a case, so a property that holds in both dtypes keeps one there and the other in the
    exhaustive tier (docs/testing.md); alternate `kept` between properties."""
    return [
        pytest.param(dtype, marks=() if dtype == kept else pytest.mark.exhaustive)
        for dtype in dtypes
    ]
