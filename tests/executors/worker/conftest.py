"""Fixtures shared by the worker tests."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.worker.cell import cached_completions


@pytest.fixture(scope="module")
def completions(tmp_path_factory) -> dict[str, str]:
    """{dtype: path} of the cached engine completions the layout-invariance tests train on."""
    paths = {}
    for dtype in ("float32", "bfloat16"):
        path = tmp_path_factory.mktemp("completions") / f"{dtype}.pt"
        torch.save(cached_completions(dtype), path)
        paths[dtype] = str(path)
    return paths
