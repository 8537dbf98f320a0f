"""The world server (tests/helpers/worker/world_server.py): the multi-rank tests share one
long-lived DeepSpeed world per world size per pytest process, so a run there must take the bits
of a launch of its own even after OTHER modules' different runs (job modules, dtypes, ZeRO
stages, thread counts, LoRA and critic runs). Negative controls: the comparison sees one
changed bit; a run that skips the fresh rank state after a run that left its process changed
does not take its bits (it fails). A rank's failure reports the text of its own launch's,
the next request runs on a fresh world, and a request past its timeout kills its world.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.helpers.worker import world_server
from tests.helpers.worker.launch import run_ranks
from tests.helpers.worker.layout_runs import BUDGET_TWO, JOB, PACKED_ONE, PADDED_TWO, layout_spec

pytestmark = pytest.mark.multiprocess
LORA = {"rank": 4, "alpha": 8, "target_modules": "all-linear"}
TIMINGS = "time/"  # metric keys allowed to differ: wall-clock timings only


def _layout(completions, layout, dtype, **kwargs) -> tuple[int, dict]:
    world, spec = layout_spec(completions, layout, dtype, **kwargs)
    return world, {"job": JOB, **spec}


def _critic(completions) -> tuple[int, dict]:
    return 2, {
        "job": "tests.helpers.worker.critic_layout_job",
        "dtype": "bfloat16",
        "model": "tiny-qwen3",
        "steps": 1,
        "completions": completions["bfloat16"],
        "critic": {"num_ranks": 2, "zero_stage": 3, "lr": 1e-2},
        "trainer": {"micro_batch_size": 2, "packing": False, "layout_invariant": True},
    }


def _others(completions) -> list[tuple[int, dict]]:
    """Runs unlike the reference, of other tests' modules: fp32 ZeRO-2 on 2 threads, LoRA
    on fp32, a PPO critic; the layout job's 'runs' (several runs in one request)."""
    return [
        _layout(completions, BUDGET_TWO, "float32", steps=1, threads=2),
        _layout(completions, PADDED_TWO, "float32", steps=1, lora=LORA),
        _critic(completions),
    ]


def _reference(completions) -> tuple[int, dict]:
    return _layout(completions, PADDED_TWO, "bfloat16", steps=2)


def _run(tmp_path, name: str, world_spec: tuple[int, dict], **kwargs) -> dict:
    world, spec = world_spec
    ranks, error = run_ranks(spec, world, tmp_path / name, timeout=300, **kwargs)
    assert error is None, error
    return ranks[0][spec["job"].rsplit(".", 1)[-1]]


def differences(a, b, where: str = "") -> list[str]:
    """Where two results differ: torch.equal on every tensor, == on every other leaf
    (wall-clock metrics aside)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
        return [] if same else [where]
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where} keys {sorted(a.keys() ^ b.keys())}"]
        keys = [key for key in a if not str(key).startswith(TIMINGS)]
        return [d for key in keys for d in differences(a[key], b[key], f"{where}/{key}")]
    if isinstance(a, list | tuple) and isinstance(b, list | tuple) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in differences(x, y, f"{where}[{i}]")]
    return [] if a == b else [where]


def test_differences_sees_one_changed_bit():
    state = {"w": torch.ones(3, dtype=torch.bfloat16), "metrics": [{"loss": 1.0, "time/s": 2}]}
    other = {"w": torch.ones(3, dtype=torch.bfloat16), "metrics": [{"loss": 1.0, "time/s": 3}]}
    assert differences(state, other) == []
    other["w"][1] = torch.nextafter(other["w"][1], torch.tensor(2.0, dtype=torch.bfloat16))
    assert differences(state, other) == ["/w"]


def test_a_run_after_other_modules_runs_takes_the_bits_of_its_own_launch(tmp_path, completions):
    """The reference run on this process's 2-rank world, after the others there (and after
    whatever this pytest process ran there before), == the reference in a launch of its own."""
    for index, other in enumerate(_others(completions)):
        _run(tmp_path, f"other{index}", other)
    pids = world_server.server_pids(2)
    shared = _run(tmp_path, "shared", _reference(completions))
    assert world_server.server_pids(2) == pids != []  # the same world ran the others
    alone = _run(tmp_path, "alone", _reference(completions), fresh=True)
    assert differences(shared, alone) == []
    assert int(alone["state"]["step"]) == 2


def _every_kind(completions) -> list[tuple[int, dict]]:
    """The other modules' 2-rank jobs (bad batches, critic ranks, mini-batches, gradient
    pages), matrix cells (ZeRO-0 fp32, ZeRO-3 bf16: no job) and the cheap guard's others."""
    jobs = ("bad_batches", "critic_ranks_job", "mini_batch_job", "gradient_pages_job")
    kinds = [
        (2, {"job": f"tests.helpers.worker.{job}", "completions": completions}) for job in jobs
    ]
    kinds.append((2, {"cells": [[0, "float32"], [3, "bfloat16"]], "completions": completions}))
    return kinds + _others(completions)


@pytest.mark.exhaustive  # make test: the cheap guard above
@pytest.mark.parametrize("reference", ["layout", "critic"])
def test_a_run_after_every_kind_of_run_takes_the_bits_of_its_own_launch(
    tmp_path, completions, reference
):
    for index, (world, spec) in enumerate(_every_kind(completions)):
        _, error = run_ranks(spec, world, tmp_path / f"other{index}", timeout=600)
        assert error is None, error
    world_spec = _reference(completions) if reference == "layout" else _critic(completions)
    shared = _run(tmp_path, "shared", world_spec)
    alone = _run(tmp_path, "alone", world_spec, fresh=True)
    assert differences(shared, alone) == []


def test_negative_control_a_run_without_the_fresh_rank_state_does_not_take_its_bits(
    tmp_path, completions
):
    """A run that leaves its process changed (grad mode off, float64 default dtype, another
    seed, no oneDNN): the next run from the fresh rank state takes the reference's bits; one
    that skips it (ds_runner's `skip_fresh_state`) does not: it fails in its backward. (Of
    what a run may leave, only grad mode changes this job's outcome: its kernels ignore the
    default dtype, thread count and oneDNN, and it draws from no global generator.)"""
    world, spec = _layout(completions, PACKED_ONE, "bfloat16", steps=2)
    leave = {
        "job": "tests.helpers.worker.process_state_job",
        "leave": {"grad": False, "default_dtype": "float64", "seed": 7, "mkldnn": False},
    }
    reference = _run(tmp_path, "reference", (world, spec))
    _run(tmp_path, "leak", (world, leave))
    assert differences(_run(tmp_path, "fresh_state", (world, spec)), reference) == []
    _run(tmp_path, "leak_again", (world, leave))
    careless = {**spec, "skip_fresh_state": True}
    _, error = run_ranks(careless, world, tmp_path / "careless", timeout=300)
    assert error is not None and "backward" in error


def test_a_failing_run_reports_its_own_launchs_error_then_a_fresh_world_runs(tmp_path, completions):
    """A real failure on the rank (the worker refuses ZeRO stage 5): the server's error text
    == a launch's of its own; the server is gone, and the next request starts a fresh one.
    Then a request past its timeout: the server is killed too."""
    world, spec = _layout(completions, PACKED_ONE, "float32", steps=1)
    _run(tmp_path, "before", (world, spec))
    before = world_server.server_pids(world)
    bad = {**spec, "stage": 5}
    _, served = run_ranks(bad, world, tmp_path / "served", timeout=300)
    _, alone = run_ranks(bad, world, tmp_path / "alone", timeout=300, fresh=True)
    assert served is not None and "zero5" in served
    assert served == alone
    assert world_server.server_pids(world) == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in before)  # killed and reaped
    after = _run(tmp_path, "after", (world, spec))
    assert world_server.server_pids(world) not in ([], before)
    assert int(after["state"]["step"]) == 1
    _assert_a_timeout_kills_the_server(tmp_path, world, spec)


def _assert_a_timeout_kills_the_server(tmp_path, world: int, spec: dict) -> None:
    """`timeout` is per request, as per launch: a world still running at it is killed."""
    pids = world_server.server_pids(world)
    _, error = run_ranks(spec, world, tmp_path / "late", timeout=0.01)
    assert error == f"ranks did not finish within 0 s; see {tmp_path / 'late'}/rank*.log"
    assert world_server.server_pids(world) == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)
