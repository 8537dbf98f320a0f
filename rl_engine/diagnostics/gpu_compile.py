"""The command line of scripts/compile_gpu_kernels.py: compile every Triton launch for NVIDIA
targets without a GPU (or launch them on one), write the manifest atomically, run the checks.

The kernels' side (capture, compile, launch; the manifest's format and checks a-d) is
`rl_engine/kernels/compile_check.py` (over the Triton backend's aot.py and aot_manifest.py); this module adds the files and the verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from rl_engine.base.io import write_json_atomic, write_text_atomic
from rl_engine.kernels.compile_check import (
    CASES,
    SHARED_LIMITS,
    check,
    compare,
    compile_targets,
    launch_on_gpu,
    require_compiled_kernels,
    summary,
)
from rl_engine.kernels.registry import OP_NAMES


def build_parser() -> argparse.ArgumentParser:
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
        records = launch_on_gpu(out_dir, args.cases, ops, write_text_atomic)
    else:
        targets = [t.strip() for t in args.targets.split(",") if t.strip()]
        bad = [t for t in targets if t not in SHARED_LIMITS]
        if bad or not targets:
            print(f"unknown targets {bad}; known: {', '.join(SHARED_LIMITS)}", file=sys.stderr)
            return 2
        records = compile_targets(targets, out_dir, args.cases, ops, write_text_atomic)
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
