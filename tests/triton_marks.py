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
