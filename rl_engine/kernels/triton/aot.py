"""Compile every Triton launch of the backend for NVIDIA targets, without a GPU, and check the binaries.

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

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.backends.driver import DriverBase

from rl_engine.kernels.triton.aot_cases import CASES, DTYPES
from rl_engine.kernels.triton.aot_manifest import (
    SHARED_LIMITS,
    check,
    compare,
    record_for,
    summary,
    write_ptx,
)


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


def compile_targets(targets, out_dir: Path, subset: str, ops) -> list[dict]:
    """Every case's launches compiled for every target by the stub driver; one record each."""
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
                        ptx = write_ptx(out_dir, target, compiled)
                        records.append(
                            record_for(op_name, dtype, case, target, launch, compiled, ptx)
                        )
            n = sum(len(ls) for _, ls in captured)
            print(
                f"{op_name:12s} {dtype}: {len(captured)} cases, {n} launches x {len(targets)} targets, {time.time() - t0:.1f} s",
                flush=True,
            )
    return records


def launch_on_gpu(out_dir: Path, subset: str, ops) -> list[dict]:
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
                    ptx = write_ptx(out_dir, target, compiled)
                    records.append(record_for(op_name, dtype, case, target, launch, compiled, ptx))
    torch.cuda.synchronize()
    return records


def build_parser() -> argparse.ArgumentParser:
    from rl_engine.kernels.registry import OP_NAMES

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--targets",
        default="sm_80,sm_90,sm_100",
        help="comma-separated, of: " + ", ".join(SHARED_LIMITS),
    )
    parser.add_argument(
        "--out", default="gpu_kernels_out", help="directory for manifest.json and the PTX"
    )
    parser.add_argument(
        "--cases",
        choices=("all", "ci"),
        default="all",
        help="ci: a documented subset (>= 2 per group)",
    )
    parser.add_argument(
        "--ops", default=",".join(OP_NAMES), help="comma-separated op names (default: every op)"
    )
    parser.add_argument(
        "--launch", action="store_true", help="run the launches on this machine's GPU"
    )
    parser.add_argument(
        "--compare", help="with --launch: an ahead-of-time manifest.json to compare hashes with"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    """The command line of scripts/compile_gpu_kernels.py: 0 all hold, 1 a check failed, 2 usage."""
    from rl_engine.base.io import write_json_atomic
    from rl_engine.kernels.registry import OP_NAMES

    args = build_parser().parse_args(argv)
    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in OP_NAMES]
    missing = [o for o in OP_NAMES if o not in CASES]
    if unknown or missing:
        print(f"unknown ops: {unknown}; registry ops without cases: {missing}", file=sys.stderr)
        return 2
    try:
        require_compiled_kernels()
    except RuntimeError as err:
        print(err, file=sys.stderr)
        return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    if args.launch:
        if not torch.cuda.is_available():
            print("--launch needs a CUDA device", file=sys.stderr)
            return 2
        records = launch_on_gpu(out_dir, args.cases, ops)
    else:
        targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        bad = [t for t in targets if t not in SHARED_LIMITS]
        if bad or not targets:
            print(f"unknown targets {bad}; known: {', '.join(SHARED_LIMITS)}", file=sys.stderr)
            return 2
        records = compile_targets(targets, out_dir, args.cases, ops)
    write_json_atomic(out_dir / "manifest.json", records)
    errors = check(records, lambda rel: (out_dir / rel).read_text())
    if args.compare:
        errors += compare(records, json.loads(Path(args.compare).read_text()))
    launches, groups, binaries = summary(records)
    print(
        f"{launches} launches, {groups} groups, {binaries} binaries, {time.time() - t0:.0f} s -> {out_dir / 'manifest.json'}"
    )
    for e in errors:
        print("FAIL", e)
    print("all checks hold" if not errors else f"{len(errors)} failures")
    return 1 if errors else 0
