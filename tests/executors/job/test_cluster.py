"""Kernel facts of the cluster's processes: a difference between two of them is refused with
an error naming the fact and both processes."""

from __future__ import annotations

import pytest

from rl_engine.executors.job.cluster import ClusterError, check_same_kernels, kernel_facts


def test_kernel_facts_differences_are_named():
    here = kernel_facts("cpu")
    assert here["torch"] and here["cpu_capability"]
    check_same_kernels({"trainer rank 0": here, "rollout engine 0": dict(here)})
    # Two CPU types cannot be produced on one machine: the second node's facts are edited.
    other = {**here, "cpu_flags": here["cpu_flags"].replace("amx_bf16", "") + " avx512_fp16"}
    with pytest.raises(
        ClusterError, match="cpu_flags .* on trainer rank 0 but .* on rollout engine 1"
    ):
        check_same_kernels({"trainer rank 0": here, "rollout engine 1": other})
