"""What every actor process does for itself: glibc's allocation settings of the trainer ranks,
and the environment it is given, set before anything reads it."""

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


# What reads an actor's environment (`cluster.actor_env`) when it is imported: the actor
# sets that environment in its constructor, after Ray imported the actor's module. (The
# kernels read RL_ENGINE_CPU_ISA per call, the op cache is read when an op is built.)
READS_THE_ENV_AT_IMPORT = ("deepspeed", "transformers", "huggingface_hub")


def test_the_actor_modules_import_nothing_that_reads_the_actor_env():
    code = (
        "import sys\n"
        "import rl_engine.executors.job.actors.launch\n"
        f"print(sorted(m for m in {READS_THE_ENV_AT_IMPORT!r} if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "[]", out.stdout
    # negative control: the same check sees one of them imported
    control = code.replace("launch\n", "launch\nimport huggingface_hub\n", 1)
    out = subprocess.run(
        [sys.executable, "-c", control], capture_output=True, text=True, check=True, timeout=120
    )
    assert out.stdout.strip() == "['huggingface_hub']", out.stdout


def test_an_actor_sets_its_env_before_anything_reads_it(monkeypatch):
    """In this process (as a Ray worker would run it): the constructor sets the env it gets."""
    monkeypatch.setenv("RL_ENGINE_TEST_ACTOR_ENV", "unset")  # restored after the test
    actor = process.JobActor(config=None, env={"RL_ENGINE_TEST_ACTOR_ENV": "set"})
    assert process.os.environ["RL_ENGINE_TEST_ACTOR_ENV"] == "set" and actor.config is None
