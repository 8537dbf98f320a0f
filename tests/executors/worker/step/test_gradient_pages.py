"""Releasing ZeRO-3's flat gradient buffer between steps (executors/worker/step/gradient_pages.py)
keeps every bit of the steps: 2 real DeepSpeed ranks (gloo, CPU accelerator), bf16, three
steps with the buffer released after each against three with it kept, from the same weights.
The negative control: the released buffer did change (it held the last step's gradients and
reads zeros after), so the equality is not that of an untouched buffer.

In-process: an optimizer without ZeRO-3's flat buffer (ZeRO-0/1/2's), or a policy that is not
dense, keeps its gradients (nothing released, the gradients' bits untouched)."""

from __future__ import annotations

import pytest
import torch

from rl_engine.executors.worker.step.gradient_pages import release_gradient_partitions
from tests.helpers.worker.cell import cached_completions
from tests.helpers.worker.launch import run_ranks


def test_an_optimizer_without_zero3s_buffer_or_a_sparse_policy_releases_nothing():
    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.full((4,), 0.5)
    plain = torch.optim.AdamW([weight])
    assert release_gradient_partitions(plain, dense=True) == 0
    assert release_gradient_partitions(plain, dense=False) == 0
    assert torch.equal(weight.grad, torch.full((4,), 0.5))


@pytest.mark.multiprocess
@pytest.mark.slow
def test_released_gradient_buffer_keeps_the_steps_bits(tmp_path):
    path = tmp_path / "completions.pt"
    torch.save(cached_completions("bfloat16"), path)
    ranks, error = run_ranks(
        {
            "job": "tests.helpers.worker.gradient_pages_job",
            "completions": {"bfloat16": str(path)},
        },
        2,
        tmp_path,
        timeout=300,
    )
    assert error is None, error
    assert ranks[0]["gradient_pages_job"]["kept"]["weights"]
    for rank in ranks:
        got = rank["gradient_pages_job"]
        released, kept = got["released"], got["kept"]
        assert released["metrics"] == kept["metrics"]
        if kept["weights"] is not None:  # rank 0 gathers the whole weights
            assert released["weights"].keys() == kept["weights"].keys()
            for name, tensor in kept["weights"].items():
                assert torch.equal(released["weights"][name], tensor), name
        assert all(m["updates"] == 1 and m["skipped_update"] == 0 for m in kept["metrics"])
        # most of the buffer is released (its ends share pages with other memory)
        assert all(b > released["buffer_bytes"] // 2 for b in released["released"])
        assert all(n > 0 for n in released["nonzero_before"])  # stale gradients were there
        assert all(n < b for n, b in zip(released["nonzero_after"], released["nonzero_before"]))
        assert kept["moe_kept"] == 0  # a policy that may skip an expert keeps its buffer
