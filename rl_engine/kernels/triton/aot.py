"""Compile every Triton launch of the backend for NVIDIA targets, without a GPU, and check the binaries.

The kernels' side: capture, compile, launch. The command line (arguments, the manifest written
atomically, the checks' verdict) is `rl_engine/diagnostics/gpu_compile.py`:

    python scripts/compile_gpu_kernels.py [--targets sm_80,sm_90,sm_100] [--out DIR] [--cases all|ci]
    python scripts/compile_gpu_kernels.py --launch --compare AOT/manifest.json --out DIR   (on a GPU)

For every op of rl_engine.kernels.registry.OP_NAMES x dtype (fp32, bf16) x launch case
(aot_cases.py), the op's own Python path runs on CPU tensors inside `capture_launches()`: the
op builds its launches with its `*_launch` functions (rl_engine/kernels/triton/_launch.py)
and they are recorded instead of run. Each recorded launch is then compiled for each target
through the JIT's own specialisation (`kernel.warmup` with the launch's real tensors and
ints, a stub driver naming the target), so what is compiled is what the op runs on a GPU.

Exit 0 iff every launch compiles and checks a-d and the shared-memory limit hold
(aot_manifest.py). Writes DIR/ptx/<target>/<kernel>-<hash>.ptx and DIR/manifest.json
(atomically; its format: aot_manifest.py).

--launch (needs CUDA): builds the same cases on the GPU, runs each launch for real and records
the hash of the binary the JIT launched; --compare checks those hashes against an ahead-of-time
manifest for this device's architecture (scripts/gpu_check.sh).

The kernels must be compiled ones: `triton.jit` reads TRITON_INTERPRET when a kernel is
decorated, so a process that imported this backend under the interpreter cannot run the
check (`main` refuses); the script unsets it before it imports anything.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from rl_engine.kernels.triton.aot_cases import CASES, DTYPES
from rl_engine.kernels.triton.aot_manifest import WriteText, record_for, write_ptx


class StubDriver(DriverBase):
    """Triton's driver interface without a GPU: it names the target the JIT compiles for.

    The device index is the compute capability, so each target has its own JIT cache.
    """

    capability = 90

    @classmethod
    def is_active(cls):
        return True

    def map_python_to_cpp_type(self, ty):
        return ty

    def get_current_target(self):
        return GPUTarget("cuda", StubDriver.capability, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("the stub driver compiles only")

    def get_current_device(self):
        return StubDriver.capability

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0


def require_compiled_kernels() -> None:
    """Raise if this process's Triton kernels were decorated under the interpreter."""
    from rl_engine.kernels.triton import INTERPRET

    if INTERPRET:
        raise RuntimeError(
            "the Triton kernels were imported under TRITON_INTERPRET=1 and have no binaries: "
            "run the compile check in a process without it (scripts/compile_gpu_kernels.py "
            "unsets it before importing rl_engine)"
        )


def capture(op_name: str, dtype: str, device: str, subset: str):
    """[(case, [Launch])] for one op and dtype: the op's own path, launches recorded."""
    from rl_engine.kernels import get_op
    from rl_engine.kernels.triton._launch import capture_launches

    op = get_op(op_name, "cuda")
    out = []
    for case, thunk in CASES[op_name](op, DTYPES[dtype], device, subset):
        torch.manual_seed(0)
        with torch.no_grad(), capture_launches() as launches:
            thunk()
        if not launches:
            raise RuntimeError(f"{op_name} {dtype} case {case}: the op launched no kernel")
        out.append((case, list(launches)))
    return out


def compile_targets(targets, out_dir: Path, subset: str, ops, write_text: WriteText) -> list[dict]:
    """Every case's launches compiled for every target by the stub driver; one record each.

    `write_text(path, text)` writes each binary's PTX under `out_dir` (the caller's file policy)."""
    require_compiled_kernels()
    StubDriver.capability = int(targets[0].removeprefix("sm_"))
    triton.runtime.driver.set_active(StubDriver())
    records = []
    for op_name in ops:
        for dtype in DTYPES:
            t0 = time.time()
            captured = capture(op_name, dtype, "cpu", subset)
            for target in targets:
                StubDriver.capability = int(target.removeprefix("sm_"))
                for case, launches in captured:
                    for launch in launches:
                        compiled = launch.warmup()
                        ptx = write_ptx(out_dir, target, compiled, write_text)
                        records.append(
                            record_for(op_name, dtype, case, target, launch, compiled, ptx)
                        )
            n = sum(len(ls) for _, ls in captured)
            print(
                f"{op_name:12s} {dtype}: {len(captured)} cases, {n} launches x {len(targets)} targets, {time.time() - t0:.1f} s",
                flush=True,
            )
    return records


def launch_on_gpu(out_dir: Path, subset: str, ops, write_text: WriteText) -> list[dict]:
    """Run every case's launches on the GPU for real; record the binaries the JIT launched."""
    require_compiled_kernels()
    major, minor = torch.cuda.get_device_capability()
    target = f"sm_{major}{minor}"
    records = []
    for op_name in ops:
        for dtype in DTYPES:
            for case, launches in capture(op_name, dtype, "cuda", subset):
                for launch in launches:
                    compiled = launch.kernel[launch.grid](
                        *launch.args, **launch.constexprs, **launch.options()
                    )
                    ptx = write_ptx(out_dir, target, compiled, write_text)
                    records.append(record_for(op_name, dtype, case, target, launch, compiled, ptx))
    torch.cuda.synchronize()
    return records
