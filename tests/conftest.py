import os
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("DS_ACCELERATOR", "cpu")
# DeepSpeed's JIT op cache inside this virtualenv, where `make setup` built it (as `rl-engine`
# does: rl_engine.cli.use_venv_op_cache). Its default (~/.cache, keyed by op name only) is shared
# by every checkout: in-process worker tests would rebuild the op when another one had.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))

# Triton's CPU interpreter, for the `triton` tests on machines without a GPU. It
# must be set before rl_engine.kernels.triton is first imported (the kernels are
# decorated at import). With a GPU the `gpu` tests run the compiled kernels.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def pytest_collection_modifyitems(config, items):
    """Lanes under xdist (`make test`: `-n 2 --dist loadgroup`). Every multi-process test runs in
    one lane, one after the other as without xdist: they start Ray clusters, DeepSpeed ranks and
    engines that would otherwise compete for the same 2 cores (and the fault tests' deadlines).
    Thread-count runs (`threads`: subprocesses without collectives) and the in-process tests go a file at a time to whichever lane is free (a module's fixtures are
    built once), beside the multi-process lane and in its gaps."""
    for item in items:
        serial = item.get_closest_marker("multiprocess") and not item.get_closest_marker("threads")
        lane = "multiprocess" if serial else item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(lane))
