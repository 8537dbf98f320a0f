"""What every actor process does for itself: glibc's allocation settings of the trainer ranks."""

import subprocess
import sys

import pytest

from rl_engine.executors.job.actors import process


def test_map_large_allocations_sets_both_thresholds(monkeypatch):
    calls = []

    class FakeGlibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(process, "_glibc", lambda: FakeGlibc())
    process.map_large_allocations()
    assert calls == [(-3, 1 << 20), (-1, 32 << 20)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD


def test_a_refused_setting_raises(monkeypatch):
    class Refusing:
        def mallopt(self, param, value):
            return 0

    monkeypatch.setattr(process, "_glibc", lambda: Refusing())
    with pytest.raises(RuntimeError, match="mallopt"):
        process.map_large_allocations()


def test_without_glibc_nothing_to_set(monkeypatch):
    monkeypatch.setattr(process, "_glibc", lambda: None)
    process.map_large_allocations()  # returns without touching anything
    assert process._malloc_trim() is None


def test_real_glibc_accepts_the_settings():
    # in a child process: the settings would otherwise stay with the test process
    code = "from rl_engine.executors.job.actors.process import map_large_allocations as m; m()"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_trainer_ranks_threshold_is_passed_through(monkeypatch):
    calls = []

    class FakeGlibc:
        def mallopt(self, param, value):
            calls.append((param, value))
            return 1

    monkeypatch.setattr(process, "_glibc", lambda: FakeGlibc())
    process.map_large_allocations(process.TRAINER_MMAP_THRESHOLD_BYTES)
    assert calls == [(-3, 128 << 10), (-1, 32 << 20)]
