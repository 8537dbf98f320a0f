"""The Triton kernels compiled for a GPU target on this CPU machine: one binary per batch, checked code.

`rl_engine.diagnostics.gpu_compile` over `rl_engine.kernels.triton.aot` (the check behind `scripts/compile_gpu_kernels.py`), called
with `--targets sm_90 --cases ci`, runs every op of the registry in fp32 and bf16 through the
JIT's own specialisation (a documented subset of the launch cases, at least 2 per group; the
script's default runs them all, for every target). This test re-derives checks a-c from the
manifest and the PTX files itself. Negative control: the same log_softmax kernel jitted with
Triton's default specialisation compiles two binaries for a 1-row view of a wider buffer and
a batch of rows (the alignment-dependent reduction order the op pins); and the layout-invariant
backward's exact GEMM, so jitted, compiles two binaries for weight partials over sequences of 7
and 16 rows (the pinned kernel: one). The manifest holds that backward's launches too
(aot_cases.py, `backward_seq*`). Plus the facts the job compares, which need no GPU.

The compiles run in one fresh interpreter (`compiled_process`) that imports the package
module and calls it: `triton.jit` reads TRITON_INTERPRET when a kernel is decorated, and this
process decorated the kernels under the interpreter (tests/conftest.py).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from rl_engine.kernels import kernel_facts
from rl_engine.kernels.registry import OP_NAMES

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compiled_process():
    """A fresh interpreter started without TRITON_INTERPRET (compiled kernels), one for the
    module's compiles: each call of `.apply` (fn, args) runs there (the start and the imports,
    seconds, paid once; every call sets the stub driver it compiles with)."""
    context = multiprocessing.get_context("spawn")
    saved = os.environ.pop("TRITON_INTERPRET", None)
    try:
        pool = context.Pool(1)  # the child copies the environment as it is now
    finally:
        if saved is not None:
            os.environ["TRITON_INTERPRET"] = saved
    with pool:
        yield pool


def _compile_check(argv: list[str]) -> int:
    from rl_engine.diagnostics import gpu_compile

    return gpu_compile.main(argv)


@pytest.fixture(scope="module")
def sm90_manifest(tmp_path_factory, compiled_process):
    out = tmp_path_factory.mktemp("gpu_kernels")
    argv = ["--targets", "sm_90", "--cases", "ci", "--out", str(out)]
    assert compiled_process.apply(_compile_check, (argv,)) == 0  # every check of the module holds
    return out, json.loads((out / "manifest.json").read_text())


@pytest.mark.triton
@pytest.mark.slow
def test_every_op_compiles_for_sm_90_with_one_binary_per_group(sm90_manifest):
    out, records = sm90_manifest
    assert isinstance(records, list)
    groups = defaultdict(list)
    for r in records:
        assert r["target"] == "sm_90" and r["dtype"] in ("fp32", "bf16")
        groups[(r["op"], r["dtype"], r["variant"])].append(r)
    for name in OP_NAMES:  # every op, both dtypes, under its own name
        for dtype in ("fp32", "bf16"):
            assert any(k[:2] == (name, dtype) for k in groups), (name, dtype)
    attention = {k[2] for k in groups if k[0] == "attention"}
    assert {"split_d64", "combine_d64", "split_d128", "combine_d128"} <= attention
    # the layout-invariant backward: its GEMM in every op that has one, rms_norm's grad x
    for name in ("linear", "lm_head", "linear_logp", "moe_router", "moe_experts"):
        assert (name, "fp32", "exact_gemm_float32") in groups, name
        assert (name, "bf16", "exact_gemm_bfloat16") in groups, name
    assert ("rms_norm", "bf16", "rms_norm_backward_block1024") in groups
    for key, rs in groups.items():  # K is a sequence's length there: several, one binary
        if key[2].startswith("exact_gemm_") and key[0] != "moe_experts":
            assert {1, 7, 16} <= {r["args"][6] for r in rs}, key
    for key, rs in groups.items():
        assert len({r["case"] for r in rs}) >= 2, key  # >= 2 launch cases per group
        assert len({r["hash"] for r in rs}) == 1, key  # a: one binary for every case
        assert len({r["kernel"] for r in rs}) == 1, key  # a group never mixes kernels
    atomic = re.compile(r"^\s*(@!?%\w+\s+)?(atom|red)\.", re.M)
    for r in records:
        ptx = (out / r["ptx"]).read_text()
        assert ".target sm_90" in ptx, r["ptx"]
        assert not atomic.search(ptx), r["ptx"]  # c
        if r["dtype"] == "fp32":
            assert "tf32" not in ptx, r["ptx"]  # b
        assert r["fp_fusion"] is False and r["num_warps"] >= 1  # d: pinned off
        assert 0 <= r["shared"] <= 227 * 1024


@pytest.mark.triton
@pytest.mark.slow
def test_every_kernel_of_the_backend_is_in_the_manifest(sm90_manifest):
    """A kernel added without launch cases would go unchecked: every `*_kernel` is compiled."""
    import importlib
    import pkgutil

    import rl_engine.kernels.triton as backend

    kernels = set()
    for info in pkgutil.iter_modules(backend.__path__):
        module = importlib.import_module(f"{backend.__name__}.{info.name}")
        kernels |= {
            name
            for name, obj in vars(module).items()
            if name.endswith("_kernel") and hasattr(obj, "fn")
        }
    assert len(kernels) >= 9
    assert kernels == {r["kernel"] for r in sm90_manifest[1]}


def _default_vs_pinned_specialisation() -> dict[str, list[str]]:
    """Hashes of log_softmax compiled for a batch of rows and for a 1-row view of a wider
    buffer: with the op's pinned specialisation, and with Triton's default one."""
    import triton

    from rl_engine.kernels.triton._launch import capture_launches
    from rl_engine.kernels.triton.aot import StubDriver, require_compiled_kernels
    from rl_engine.kernels.triton.log_softmax import log_softmax_forward

    require_compiled_kernels()
    triton.runtime.driver.set_active(StubDriver())
    vocab = 50257

    def launch_of(x):
        with capture_launches() as launches:
            log_softmax_forward(x, 1.0)
        return launches[0]

    batch = launch_of(torch.empty(7, vocab))
    view = launch_of(torch.empty(4, vocab + 15)[:1, :vocab])  # "contiguous", the wide stride
    plain = triton.JITFunction(batch.kernel.fn)  # the same kernel, Triton's default specialisation

    def hash_of(kernel, launch):
        options = {**launch.constexprs, **launch.options()}
        return kernel.warmup(*launch.args, grid=(1,), **options).hash

    return {
        "pinned": [hash_of(batch.kernel, batch), hash_of(batch.kernel, view)],
        "plain": [hash_of(plain, batch), hash_of(plain, view)],
    }


def _exact_gemm_specialisation() -> dict[str, list[str]]:
    """Hashes of the backward's exact GEMM compiled for a weight partial over a 7-row and a
    16-row sequence: with its pinned (no) specialisation, and with Triton's default one."""
    import triton

    from rl_engine.kernels.triton._launch import capture_launches
    from rl_engine.kernels.triton._matmul import exact_gemm
    from rl_engine.kernels.triton.aot import StubDriver, require_compiled_kernels

    require_compiled_kernels()
    triton.runtime.driver.set_active(StubDriver())

    def launch_of(rows):
        with capture_launches() as launches:
            exact_gemm(torch.empty(1152, rows), torch.empty(896, rows))  # dy_s^T, x_s^T
        return launches[0]

    short, full = launch_of(7), launch_of(16)
    plain = triton.JITFunction(short.kernel.fn)

    def hash_of(kernel, launch):
        options = {**launch.constexprs, **launch.options()}
        return kernel.warmup(*launch.args, grid=(1,), **options).hash

    return {
        "pinned": [hash_of(short.kernel, short), hash_of(short.kernel, full)],
        "plain": [hash_of(plain, short), hash_of(plain, full)],
    }


@pytest.mark.triton
@pytest.mark.slow
def test_negative_control_default_specialisation_splits_sequence_lengths(compiled_process):
    """The backward's GEMM sums a weight partial over K = a sequence's length: Triton's default
    specialisation (K % 16) compiles two binaries for 7 and 16 rows; the pinned one, one."""
    hashes = compiled_process.apply(_exact_gemm_specialisation)
    assert hashes["pinned"][0] == hashes["pinned"][1]
    assert hashes["plain"][0] != hashes["plain"][1]


@pytest.mark.triton
@pytest.mark.slow
def test_negative_control_default_specialisation_splits_a_batch_from_a_view(compiled_process):
    hashes = compiled_process.apply(_default_vs_pinned_specialisation)
    assert hashes["pinned"][0] == hashes["pinned"][1]
    assert hashes["plain"][0] != hashes["plain"][1]


def test_the_check_refuses_interpreted_kernels(tmp_path, capsys):
    """Fail closed: kernels decorated under the interpreter have no binaries to check."""
    from rl_engine.diagnostics import gpu_compile
    from rl_engine.kernels.triton import INTERPRET

    if not INTERPRET:
        pytest.skip("this process's Triton kernels are compiled ones")
    assert gpu_compile.main(["--targets", "sm_90", "--ops", "silu", "--out", str(tmp_path)]) == 2
    assert "TRITON_INTERPRET" in capsys.readouterr().err
    assert not (tmp_path / "manifest.json").exists()


def test_cuda_kernel_facts_name_the_triton_numerics_without_a_gpu():
    from rl_engine.kernels.triton._launch import NUMERICS_VERSION

    facts = kernel_facts("cuda")
    assert facts["backend"] == "triton"
    assert facts["triton_numerics"] == NUMERICS_VERSION
    assert facts["triton_version"] == __import__("triton").__version__
    assert facts["triton_fp_fusion"] == "off"
    assert facts["triton_mode"] in ("interpreter", "compiled")
    if not torch.cuda.is_available():
        assert not torch.cuda.is_initialized()


def test_job_refuses_actors_on_different_triton_builds():
    from rl_engine.executors.job.cluster import ClusterError, check_same_kernels
    from rl_engine.executors.job.cluster import kernel_facts as job_facts

    here = job_facts("cuda")
    assert here["kernels.triton_numerics"] and here["kernels.triton_version"]
    check_same_kernels({"trainer rank 0": here, "rollout engine 0": dict(here)})
    for key in ("kernels.triton_version", "kernels.triton_numerics", "kernels.triton_fp_fusion"):
        other = {**here, key: "something else"}
        with pytest.raises(ClusterError, match=re.escape(key)):
            check_same_kernels({"trainer rank 0": here, "rollout engine 1": other})


def test_pyproject_bounds_the_triton_version_to_the_installed_minor():
    import triton
    from packaging.specifiers import SpecifierSet

    (spec,) = re.findall(r'"triton([<>=!~][^"]*)"', (ROOT / "pyproject.toml").read_text())
    spec = SpecifierSet(spec)
    assert any(s.operator == "<" for s in spec), spec  # an upper bound: numerics move with Triton
    assert triton.__version__ in spec
    major, minor = map(int, triton.__version__.split(".")[:2])
    assert f"{major}.{minor + 1}.0" not in spec
