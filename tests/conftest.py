import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")

# Triton's CPU interpreter, for the `triton` tests on machines without a GPU. It
# must be set before rl_engine.kernels.triton is first imported (the kernels are
# decorated at import). With a GPU the `gpu` tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
