"""Compile every Triton launch of the backend for NVIDIA targets, without a GPU, and check the binaries.

    python scripts/compile_gpu_kernels.py [--targets sm_80,sm_90,sm_100] [--out DIR] [--cases all|ci]
    python scripts/compile_gpu_kernels.py --launch --compare AOT/manifest.json --out DIR   (on a GPU)

For every op of rl_engine.kernels.registry.OP_NAMES x dtype (fp32, bf16) x launch case, the
op's own Python path runs on CPU tensors inside `capture_launches()`: the op builds its
launches with its `*_launch` functions (rl_engine/kernels/triton/_launch.py) and they are
recorded instead of run. Each recorded launch is then compiled for each target through the
JIT's own specialisation (`kernel.warmup` with the launch's real tensors and ints, a stub
driver naming the target), so what is compiled is what the op runs on a GPU.

Checks (exit 0 iff every launch compiles and all hold):
  a. batch independence: within one (op, dtype, variant, target) every case has one binary hash;
  b. fp32 variants contain no TF32 instruction;
  c. no kernel contains atomic or reduction-to-memory instructions (atom., red., cp.reduce);
  d. each kernel's compiled FP-fusion option is the pinned one (rl_engine.kernels.triton._launch);
  plus: each kernel's shared memory is within the target's limit.

Writes DIR/ptx/<target>/<kernel>-<hash>.ptx and DIR/manifest.json (atomically): a JSON list,
one record per launch: op, dtype, variant, case, target, kernel, hash, ptx (relative to DIR),
shared (bytes), shared_limit, fp_fusion, num_warps, num_stages, signature and specialisation
attributes of the compile, constexprs, grid.

--launch (needs CUDA): builds the same cases on the GPU, runs each launch for real and records
the hash of the binary the JIT launched; --compare checks those hashes against an ahead-of-time
manifest for this device's architecture (scripts/gpu_check.sh).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys
import time
from collections import defaultdict
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels only: the interpreter has no binaries

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.backends.driver import DriverBase  # noqa: E402

# Largest shared memory one block may use (the opt-in maximum, bytes).
SHARED_LIMITS = {
    "sm_80": 163 * 1024,
    "sm_86": 99 * 1024,
    "sm_89": 99 * 1024,
    "sm_90": 227 * 1024,
    "sm_100": 227 * 1024,
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# An instruction that reads-modifies-writes memory (an atomic or a reduction to memory).
_ATOMIC = re.compile(r"^\s*(@!?%\w+\s+)?(atom|red|multimem\.red|cp\.reduce\.async)\.", re.M)
_TF32 = re.compile(r"\btf32\b")


class _StubDriver(DriverBase):
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
        return GPUTarget("cuda", _StubDriver.capability, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def get_benchmarker(self):
        raise NotImplementedError("the stub driver compiles only")

    def get_current_device(self):
        return _StubDriver.capability

    def set_current_device(self, device):
        pass

    def get_current_stream(self, device=None):
        return 0


# --- launch cases: op name -> builder(dtype, device, subset) -> [(case, thunk)] ------------------

# Qwen2.5-0.5B-like sizes (H 896, 14 query heads, 2 kv heads, D 64, I 4864), smaller expert MLPs.
H, HQ, HKV, D, INTER = 896, 14, 2, 64, 4864
VOCABS = (151936, 50257, 32001)  # 50257, 32001: not divisible by 16
E, TOP_K, MOE_INTER = 64, 8, 256
ROWS = (1, 7, 16, 4096)
CI_ROWS = (1, 7)


def _rows(subset):
    return CI_ROWS if subset == "ci" else ROWS


def _row_cases(make, dt, dev, subset, width):
    """The row layouts every row-wise op is launched with: row counts, a row-offset slice
    (aligned and off a 16-byte boundary), a 1-row view of a wider buffer."""
    cases = [
        (f"rows{m}", lambda m=m: make(torch.empty(m, width, dtype=dt, device=dev)))
        for m in _rows(subset)
    ]

    def offset(start):
        buf = torch.empty(16 * width + 64, dtype=dt, device=dev)
        return make(buf[start : start + 9 * width].view(9, width))

    def wide_view():
        return make(torch.empty(4, width + 64, dtype=dt, device=dev)[:1, :width])

    cases += [("offset_rows", lambda: offset(3 * width)), ("offset_unaligned", lambda: offset(1))]
    cases.append(("row_of_wider_buffer", wide_view))
    if subset == "ci":
        return [
            c
            for c in cases
            if c[0] in ("rows1", "rows7", "row_of_wider_buffer", "offset_unaligned")
        ]
    return cases


def _embedding_cases(op, dt, dev, subset):
    w = torch.empty(VOCABS[0], H, dtype=dt, device=dev)

    def ids(n):
        return torch.randint(0, VOCABS[0], (n,), device=dev)

    cases = [(f"tokens{n}", lambda n=n: op(ids(n), w)) for n in _rows(subset)]
    cases.append(("ids_2d_slice", lambda: op(ids(64).view(8, 8)[:, 1:5], w)))
    return cases


def _linear_cases(op, dt, dev, subset):
    w = torch.empty(1152, H, dtype=dt, device=dev)
    b = torch.empty(1152, dtype=dt, device=dev)
    cases = _row_cases(lambda x: op(x, w), dt, dev, subset, H)
    return cases + [
        (f"{c}_bias", f) for c, f in _row_cases(lambda x: op(x, w, b), dt, dev, subset, H)
    ]


def _lm_head_cases(op, dt, dev, subset):
    cases = []
    for vocab in VOCABS if subset != "ci" else VOCABS[:2]:
        w = torch.empty(vocab, H, dtype=dt, device=dev)
        cases += [
            (f"V{vocab}_{c}", f) for c, f in _row_cases(lambda x, w=w: op(x, w), dt, dev, subset, H)
        ]
    return cases


def _rms_norm_cases(op, dt, dev, subset):
    cases = []
    for width in (H, 4096) if subset != "ci" else (H,):  # the chunk width follows H
        w = torch.empty(width, dtype=dt, device=dev)
        rows = _row_cases(lambda x, w=w: op(x, w, 1e-6), dt, dev, subset, width)
        cases += [(f"H{width}_{c}", f) for c, f in rows]
    return cases


def _elementwise_cases(op, dt, dev, subset):
    return _row_cases(op, dt, dev, subset, INTER)


def _log_softmax_cases(op, dt, dev, subset):
    cases = []
    for vocab in VOCABS if subset != "ci" else VOCABS[:2]:
        for c, f in _row_cases(lambda x: op(x, 0.7), dt, dev, subset, vocab):
            cases.append((f"V{vocab}_{c}", f))
    return cases


def _linear_logp_cases(op, dt, dev, subset):
    cases = []
    for vocab in VOCABS[:2]:
        w = torch.empty(vocab, H, dtype=dt, device=dev)
        for n in _rows(subset) + ((300,) if subset != "ci" else ()):  # 300: several chunks

            def run(n=n, w=w, vocab=vocab):
                t = torch.randint(0, vocab, (n,), device=dev)
                return op(torch.empty(n, H, dtype=dt, device=dev), w, t, temperature=0.7)

            cases.append((f"V{vocab}_tokens{n}", run))
    return cases


def _moe_router_cases(op, dt, dev, subset):
    w = torch.empty(E, H, dtype=dt, device=dev)
    cases = []
    for renorm in (False, True):
        for n in _rows(subset) + ((33,) if subset != "ci" else ()):
            cases.append(
                (
                    f"tokens{n}{'_renorm' if renorm else ''}",
                    lambda n=n, r=renorm: op(
                        torch.empty(n, H, dtype=dt, device=dev), w, TOP_K, renormalize=r
                    ),
                )
            )
    return cases


def _moe_experts_cases(op, dt, dev, subset):
    gate_up = torch.empty(E, 2 * MOE_INTER, H, dtype=dt, device=dev)
    down = torch.empty(E, H, MOE_INTER, dtype=dt, device=dev)

    def run(n, experts):
        g = torch.Generator().manual_seed(n)
        idx = torch.stack([torch.randperm(experts, generator=g)[:TOP_K] for _ in range(n)]).to(dev)
        weights = torch.empty(n, TOP_K, dtype=dt, device=dev)
        return op(torch.empty(n, H, dtype=dt, device=dev), gate_up, down, idx, weights)

    counts = (1, 7, 64) if subset != "ci" else (1, 7)
    # few experts: each receives many rows; all experts: most receive one or none
    return [(f"tokens{n}_experts{x}", lambda n=n, x=x: run(n, x)) for n in counts for x in (8, E)]


def _attention_cases(op, dt, dev, subset):
    """Decode, prefill and chunked prefill at several cache lengths and slot layouts; packed rows.
    Positions past 1024 (the GPU's KV split) run the combine kernel."""

    head_dim = D

    def qkv(b, t, s=None, cap=None):
        q = torch.empty(b, t, HQ, head_dim, dtype=dt, device=dev).transpose(1, 2)  # (B, Hq, T, D)
        kv = torch.empty(s or b, HKV, cap or t, head_dim, dtype=dt, device=dev)
        return q, kv, torch.empty_like(kv)

    def prefill(lengths):
        t = max(lengths)
        q, k, v = qkv(len(lengths), t)
        pos = torch.full((len(lengths), t), -1, dtype=torch.long, device=dev)
        for i, n in enumerate(lengths):  # left padded
            pos[i, t - n :] = torch.arange(n, device=dev)
        kpos = pos.clone()
        return op(q, k, v, q_positions=pos, k_positions=kpos)

    def prefill_aligned(t, b=2):
        q, k, v = qkv(b, t)
        pos = torch.arange(t, device=dev).expand(b, t).contiguous()
        return op(q, k, v, q_positions=pos)

    def decode(cache_lengths, cap):
        b = len(cache_lengths)
        q, k, v = qkv(b, 1, s=b + 2, cap=cap)
        pos = torch.tensor([[n] for n in cache_lengths], device=dev)
        kv_index = torch.arange(b, device=dev).flip(0) + 1
        return op(q, k, v, q_positions=pos, kv_index=kv_index)

    def decode_shuffled_slots(n, cap):
        q, k, v = qkv(2, 1, cap=cap)
        kpos = torch.full((2, cap), -1, dtype=torch.long, device=dev)
        kpos[:, : n + 1] = torch.stack([torch.randperm(n + 1), torch.randperm(n + 1)]).to(dev)
        pos = torch.tensor([[n], [n // 2]], device=dev)
        return op(q, k, v, q_positions=pos, k_positions=kpos)

    def chunked(start, t, cap):
        q, k, v = qkv(1, t, s=3, cap=cap)
        pos = torch.arange(start, start + t, device=dev).view(1, t)
        return op(q, k, v, q_positions=pos, kv_index=torch.tensor([2], device=dev))

    def packed(lengths):
        t = sum(lengths)
        q, k, v = qkv(1, t)
        pos = torch.cat([torch.arange(n) for n in lengths]).view(1, t).to(dev)
        seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]).view(1, t).to(dev)
        return op(
            q,
            k,
            v,
            q_positions=pos,
            k_positions=pos.clone(),
            q_segments=seg,
            k_segments=seg.clone(),
        )

    cases = [
        ("decode_cache17", lambda: decode([17, 3], 128)),
        ("decode_cache1100", lambda: decode([1100, 40], 1152)),
        ("decode_cache3000", lambda: decode([3000, 2999, 5], 3072)),
        ("decode_shuffled_slots1500", lambda: decode_shuffled_slots(1500, 1536)),
        ("prefill_left_padded", lambda: prefill([40, 13])),
        ("prefill_aligned1200", lambda: prefill_aligned(1200)),
        ("chunked_prefill_at1000", lambda: chunked(1000, 100, 1152)),
        ("chunked_prefill_at2048", lambda: chunked(2048, 64, 2176)),
        ("packed_3_sequences", lambda: packed([30, 7, 50])),
        ("packed_long", lambda: packed([1100, 60])),
    ]
    if subset == "ci":
        keep = (
            "decode_cache17",
            "decode_cache1100",
            "decode_cache3000",
            "chunked_prefill_at1000",
            "packed_3_sequences",
        )
        cases = [c for c in cases if c[0] in keep]
    cases = [(f"D{D}_{c}", f) for c, f in cases]

    def at_head_dim(d, f):
        nonlocal head_dim
        head_dim = d
        try:
            return f()
        finally:
            head_dim = D

    # other head dims (another BLOCK_D: another variant): Llama / Qwen3's 128, Gemma's 256
    other = [
        ("decode_cache17", lambda: decode([17, 3], 128)),
        ("decode_cache1100", lambda: decode([1100, 40], 1152)),
        ("chunked_prefill_at2048", lambda: chunked(2048, 64, 2176)),
    ]
    for d in (128, 256) if subset != "ci" else (128,):
        cases += [(f"D{d}_{c}", lambda d=d, f=f: at_head_dim(d, f)) for c, f in other]
    return cases


CASES = {
    "embedding": _embedding_cases,
    "linear": _linear_cases,
    "lm_head": _lm_head_cases,
    "rms_norm": _rms_norm_cases,
    "silu": _elementwise_cases,
    "sigmoid": _elementwise_cases,
    "log_softmax": _log_softmax_cases,
    "attention": _attention_cases,
    "linear_logp": _linear_logp_cases,
    "moe_router": _moe_router_cases,
    "moe_experts": _moe_experts_cases,
}


# --- capture, compile, check ------------------------------------------------------------------


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


def record_for(op_name, dtype, case, target, launch, compiled, ptx_rel):
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
    rel = Path("ptx") / target / f"{compiled.name}-{compiled.hash[:20]}.ptx"
    path = out_dir / rel
    if not path.exists():
        from rl_engine.io import write_text_atomic

        write_text_atomic(path, compiled.asm["ptx"])
    return str(rel)


def check(records: list[dict], ptx_text) -> list[str]:
    """The failures of checks a-d and the shared-memory limit ([] = all hold)."""
    errors = []
    groups = defaultdict(set)
    for r in records:
        groups[(r["op"], r["dtype"], r["variant"], r["target"])].add(r["hash"])
    for key, hashes in sorted(groups.items()):
        if len(hashes) != 1:  # a
            cases = sorted(
                {
                    r["case"] + "=" + r["hash"][:10]
                    for r in records
                    if (r["op"], r["dtype"], r["variant"], r["target"]) == key
                }
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


def compile_targets(targets, out_dir: Path, subset: str, ops) -> list[dict]:
    _StubDriver.capability = int(targets[0].removeprefix("sm_"))
    triton.runtime.driver.set_active(_StubDriver())
    records = []
    for op_name in ops:
        for dtype in DTYPES:
            t0 = time.time()
            captured = capture(op_name, dtype, "cpu", subset)
            for target in targets:
                _StubDriver.capability = int(target.removeprefix("sm_"))
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


def compare(launched: list[dict], aot: list[dict]) -> list[str]:
    """Each launched binary is the ahead-of-time one of its group and target: hash and cubin."""
    expected = {(r["op"], r["dtype"], r["variant"], r["target"]): r for r in aot}
    errors = []
    for r in launched:
        key = (r["op"], r["dtype"], r["variant"], r["target"])
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


def main(argv=None) -> int:
    from rl_engine.io import write_json_atomic
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
    args = parser.parse_args(argv)

    ops = [o for o in args.ops.split(",") if o]
    unknown = [o for o in ops if o not in OP_NAMES]
    missing = [o for o in OP_NAMES if o not in CASES]
    if unknown or missing:
        print(f"unknown ops: {unknown}; registry ops without cases: {missing}", file=sys.stderr)
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
        import json

        errors += compare(records, json.loads(Path(args.compare).read_text()))
    groups = {(r["op"], r["dtype"], r["variant"], r["target"]) for r in records}
    binaries = {(r["target"], r["hash"]) for r in records}
    print(
        f"{len(records)} launches, {len(groups)} groups, {len(binaries)} binaries, {time.time() - t0:.0f} s -> {out_dir / 'manifest.json'}"
    )
    for e in errors:
        print("FAIL", e)
    print("all checks hold" if not errors else f"{len(errors)} failures")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
