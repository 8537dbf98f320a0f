"""The GPU compile check's manifest: one record per compiled launch, and the checks on it.

`DIR/manifest.json` is a JSON list, one record per launch: op, dtype, variant, case,
target, kernel, hash, cubin_sha256, ptx (relative to DIR), shared (bytes), shared_limit,
fp_fusion, fp_fusion_pinned, launch_fp_fusion, num_warps, num_stages, grid, signature and
specialisation attributes of the compile, constexprs, args. scripts/gpu_check.sh compares
two of them (`compare`); tests/kernels/test_gpu_compile.py re-derives the checks from it.

Checks (`check`; [] = all hold):
  a. batch independence: within one (op, dtype, variant, target) every case has one binary hash;
  b. fp32 variants contain no TF32 instruction;
  c. no kernel contains atomic or reduction-to-memory instructions (atom., red., cp.reduce);
  d. each kernel's compiled FP-fusion option is the pinned one (rl_engine.kernels.triton._launch);
  plus: each kernel's shared memory is within the target's limit.
"""

from __future__ import annotations

import hashlib
import re
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

# Largest shared memory one block may use (the opt-in maximum, bytes).
SHARED_LIMITS = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
    "sm_100": 227 * 1024,
}
# An instruction that reads-modifies-writes memory (an atomic or a reduction to memory).
_ATOMIC = re.compile(r"^\s*(@!?%\w+\s+)?(atom|red|multimem\.red|cp\.reduce\.async)\.", re.M)
_TF32 = re.compile(r"\btf32\b")


def group_of(record: dict) -> tuple[str, str, str, str]:
    """The group a record belongs to: every case of it must compile to one binary."""
    return record["op"], record["dtype"], record["variant"], record["target"]


def describe_args(launch) -> list:
    """The launch's runtime arguments as the manifest shows them (tensors by dtype/shape/stride)."""
    shown = []
    for a in launch.args:
        if isinstance(a, torch.Tensor):
            shown.append(
                {
                    "dtype": str(a.dtype).removeprefix("torch."),
                    "shape": list(a.shape),
                    "stride": list(a.stride()),
                    "align16": a.data_ptr() % 16 == 0,
                }
            )
        else:
            shown.append(a)
    return shown


def record_for(op_name, dtype, case, target, launch, compiled, ptx_rel) -> dict:
    """The manifest record of one launch compiled for one target."""
    from rl_engine.kernels.triton._launch import FP_FUSION

    src = compiled.src
    return {
        "op": op_name,
        "dtype": dtype,
        "variant": launch.variant,
        "case": case,
        "target": target,
        "kernel": compiled.name,
        "hash": compiled.hash,
        "cubin_sha256": hashlib.sha256(compiled.asm["cubin"]).hexdigest(),
        "ptx": ptx_rel,
        "shared": int(compiled.metadata.shared),
        "shared_limit": SHARED_LIMITS.get(target),
        "fp_fusion": bool(compiled.metadata.enable_fp_fusion),
        "fp_fusion_pinned": FP_FUSION,
        "launch_fp_fusion": launch.fp_fusion,
        "num_warps": int(compiled.metadata.num_warps),
        "num_stages": int(compiled.metadata.num_stages),
        "grid": list(launch.grid),
        "signature": {k: str(v) for k, v in src.signature.items()},
        "specialisation": {str(k): str(v) for k, v in src.attrs.items()},
        "constexprs": {k: str(v) for k, v in launch.constexprs.items()},
        "args": describe_args(launch),
    }


def write_ptx(out_dir: Path, target: str, compiled) -> str:
    """Write the kernel's PTX once (many launches share one binary); its path relative to out_dir."""
    rel = Path("ptx") / target / f"{compiled.name}-{compiled.hash[:20]}.ptx"
    path = out_dir / rel
    if not path.exists():
        from rl_engine.base.io import write_text_atomic

        write_text_atomic(path, compiled.asm["ptx"])
    return str(rel)


def check(records: list[dict], ptx_text: Callable[[str], str]) -> list[str]:
    """The failures of checks a-d and the shared-memory limit ([] = all hold)."""
    errors = []
    groups = defaultdict(set)
    for r in records:
        groups[group_of(r)].add(r["hash"])
    for key, hashes in sorted(groups.items()):
        if len(hashes) != 1:  # a
            cases = sorted(
                {r["case"] + "=" + r["hash"][:10] for r in records if group_of(r) == key}
            )
            errors.append(f"a: {key} compiles {len(hashes)} binaries: {', '.join(cases)}")
    tf32, atomics = {}, {}  # per PTX file (many launches share one binary)
    for rel in sorted({r["ptx"] for r in records}):
        text = ptx_text(rel)
        tf32[rel] = bool(_TF32.search(text))
        hit = _ATOMIC.search(text)
        atomics[rel] = hit.group(0).strip() if hit else None
    for r in records:
        where = f"{r['op']} {r['dtype']} {r['variant']} {r['case']} {r['target']}"
        if r["dtype"] == "fp32" and tf32[r["ptx"]]:  # b
            errors.append(f"b: {where}: TF32 instruction in {r['ptx']}")
        if atomics[r["ptx"]]:  # c
            errors.append(f"c: {where}: {atomics[r['ptx']]!r} in {r['ptx']}")
        if not (r["fp_fusion"] == r["launch_fp_fusion"] == r["fp_fusion_pinned"]):  # d
            errors.append(
                f"d: {where}: fp_fusion {r['fp_fusion']} is not the pinned {r['fp_fusion_pinned']}"
            )
        if r["shared_limit"] is not None and r["shared"] > r["shared_limit"]:
            errors.append(f"shared: {where}: {r['shared']} B > {r['shared_limit']} B")
    return errors


def compare(launched: list[dict], aot: list[dict]) -> list[str]:
    """Each launched binary is the ahead-of-time one of its group and target: hash and cubin."""
    expected = {group_of(r): r for r in aot}
    errors = []
    for r in launched:
        key = group_of(r)
        ahead = expected.get(key)
        if ahead is None:
            errors.append(f"launched {key} ({r['case']}) has no ahead-of-time record")
        elif ahead["hash"] != r["hash"]:
            errors.append(
                f"launched {key} ({r['case']}) ran {r['hash'][:12]}, "
                f"ahead of time {ahead['hash'][:12]}"
            )
        elif ahead["cubin_sha256"] != r["cubin_sha256"]:  # one compile, one machine code
            errors.append(
                f"launched {key} ({r['case']}): its cubin differs from the ahead-of-time one"
            )
    return errors


def summary(records: list[dict]) -> tuple[int, int, int]:
    """(launches, groups, distinct binaries) of a manifest: the counts docs/benchmarks.md records."""
    groups = {group_of(r) for r in records}
    binaries = {(r["target"], r["hash"]) for r in records}
    return len(records), len(groups), len(binaries)
