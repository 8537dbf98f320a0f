"""The `rl_engine.executors` package: its names resolve lazily to the objects of the modules that
define them (importing the package loads neither torch, DeepSpeed nor transformers), and an
unknown name is an AttributeError naming it."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import rl_engine.executors as executors

DEFINED_IN = {
    "TrainBatch": "rl_engine.executors.worker.batch",
    "BatchError": "rl_engine.executors.worker.errors",
    "ParityError": "rl_engine.executors.worker.errors",
    "DeepSpeedTrainingWorker": "rl_engine.executors.worker.policy.worker",
    "build_deepspeed_config": "rl_engine.executors.worker.ds_config",
    "CriticWorker": "rl_engine.executors.worker.critic.worker",
}


def test_the_package_exports_exactly_these_names():
    assert sorted(executors.__all__) == sorted(DEFINED_IN)


@pytest.mark.parametrize("name", sorted(DEFINED_IN))
def test_each_exported_name_is_the_defining_modules_object(name):
    module = importlib.import_module(DEFINED_IN[name])
    assert getattr(executors, name) is getattr(module, name)


def test_an_unknown_name_is_named():
    with pytest.raises(AttributeError, match="'rl_engine.executors' has no attribute 'Trainer'"):
        executors.Trainer  # noqa: B018


def test_importing_the_package_loads_no_heavy_dependency():
    code = (
        "import sys, rl_engine.executors; "
        "print(sorted(m for m in ('torch', 'deepspeed', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
