import os

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
