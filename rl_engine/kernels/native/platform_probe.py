"""Start-up probe of the platform assumption native's fixed-order GEMM rests on.

`_tiles.tiled_matmul` fixes every library call's shape; what it cannot fix is
how the library (MKL / oneDNN on CPU, cuBLAS on GPU) computes a call of that
shape. The row-invariance contract holds if, for one fixed-shape tile call,
each output row's bits depend on that row's data alone. Concretely:

- "other rows": not on the tile's other rows (zero padding, large values, data);
- "row position": not on the row's position in its tile, or the tile's in the batch;
- "thread count": not on the intra-op thread count (CPU: 1, 2 and the process's);
- "weight address": not on where the weight lives in memory (a trainer and a
  rollout engine hold the same weights at different addresses).

Nobody can list every CPU this code meets, so the first native
linear / lm_head / linear_logp / moe_router / moe_experts / attention call with a
dtype on a device type measures the assumption on probe tiles (two K slices: a full
one and a narrow remainder; N = 1 and N = 333), in the production code path, and
caches the outcome for the process (attention's scores and p @ v are fixed-shape
`torch.bmm` calls, library GEMMs resting on the same assumption, so it asks the same
probe). Where it fails, those ops raise PlatformInvarianceError for that dtype only,
every time, naming the dtype and the assumption (the op's
guard asks `platform_refusal`; `require_invariant_platform` is the same check for
callers of the tile scheme outside an op). Nothing skips it but a caller's explicit
`get_op(..., allow_non_invariant=True)`, which gives up the guarantee: a native
result on such a machine would otherwise silently break trainer == rollout parity.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch

from rl_engine.kernels.errors import PlatformInvarianceError
from rl_engine.kernels.native._tiles import (
    TILE_ROWS,
    accumulator_dtype,
    k_slice_for,
    tiled_matmul,
)

ASSUMPTIONS = {
    "other rows": "a row's bits do not depend on the other rows of its tile "
    "(zero padding, large values, other data)",
    "row position": "a row's bits do not depend on its position in the tile "
    "or on the tile's position in the batch",
    "thread count": "a tile's bits do not depend on the intra-op thread count",
    "weight address": "a tile's bits do not depend on the weight's address in memory",
}

# Probe shapes: N = 1 (a GEMV-like call), an odd N that leaves partial column blocks and a
# round one; K = six full slices plus a narrow remainder slice (on an AVX-512 Xeon without
# bf16 instructions, bf16 rows summed over several slices changed bits at 3 threads, N 512).
PROBE_OUTPUTS = (1, 333, 512)
PROBE_SLICES = 6
REMAINDER_COLUMNS = 37
THREAD_COUNTS = (1, 2, 3)  # each compared with the process's own count (3: a split of its own)
# The device's default backend, and the dtypes it serves with its own fixed-order
# kernels (its other dtypes go through a library GEMM as well).
OTHER_BACKEND = {
    "cpu": ("cpp", (torch.float32, torch.bfloat16)),
    "cuda": ("triton", (torch.float32, torch.bfloat16)),
}


@dataclass(frozen=True, slots=True)
class ProbeResult:
    """Outcome of the probe for one dtype on one device type."""

    dtype: torch.dtype
    device_type: str
    failures: tuple[tuple[str, str], ...]
    """(assumption, what was seen) for every assumption that did not hold; empty: accepted."""

    @property
    def accepted(self) -> bool:
        return not self.failures

    @property
    def outcome(self) -> str:
        """'invariant', or 'refused: <assumption>, ...' (the kernel_facts value)."""
        if self.accepted:
            return "invariant"
        return "refused: " + ", ".join(name for name, _ in self.failures)


def require_invariant_platform(dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise PlatformInvarianceError if the probe refused `dtype` on this device type."""
    reason = platform_refusal(dtype, torch.device(device).type)
    if reason is not None:
        raise PlatformInvarianceError(reason)


def platform_refusal(dtype: torch.dtype, device_type: str) -> str | None:
    """Why the probe refused `dtype` on `device_type` (the error message), or None if it accepted."""
    result = probe(dtype, device_type)
    return None if result.accepted else refusal_message(result)


@cache
def probe(dtype: torch.dtype, device_type: str) -> ProbeResult:
    """Measure the assumption for `dtype` on `device_type` (once per process)."""
    with torch.no_grad():
        failures = _failed_assumptions(dtype, torch.device(device_type))
    return ProbeResult(dtype, device_type, tuple(failures))


def refusal_message(result: ProbeResult) -> str:
    name = str(result.dtype).removeprefix("torch.")
    seen = "; ".join(f"{ASSUMPTIONS[a]}: false here ({what})" for a, what in result.failures)
    return (
        f"backend 'native' cannot guarantee row invariance for {name} on this "
        f"{result.device_type} ({_machine(result.device_type)}, torch {torch.__version__}): "
        f"its fixed-shape tile GEMM assumes that {seen}. {_instead(result)} "
        f"Native still serves the dtypes whose probe passes."
    )


def _instead(result: ProbeResult) -> str:
    name = str(result.dtype).removeprefix("torch.")
    backend, own_dtypes = OTHER_BACKEND.get(result.device_type, ("cpp", ()))
    if result.dtype in own_dtypes:
        return f"Use backend '{backend}' for {name} (the default on {result.device_type})."
    served = " and ".join(str(d).removeprefix("torch.") for d in own_dtypes)
    return (
        f"No backend here is row-invariant for {name}: '{backend}' has fixed-order "
        f"kernels for {served} only; compute in one of those."
    )


def _measure(x: torch.Tensor, w: torch.Tensor, threads: int | None = None) -> torch.Tensor:
    """The production tile scheme on the probe tile, with `threads` intra-op threads if given."""
    if threads is None:
        return tiled_matmul(x, w, out_dtype=accumulator_dtype(x.dtype))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return tiled_matmul(x, w, out_dtype=accumulator_dtype(x.dtype))
    finally:
        torch.set_num_threads(before)


def _failed_assumptions(dtype: torch.dtype, device: torch.device) -> list[tuple[str, str]]:
    failures: dict[str, str] = {}
    for n in PROBE_OUTPUTS:
        for assumption, mismatch in _mismatches(dtype, device, n):
            if mismatch and assumption not in failures:
                failures[assumption] = (
                    f"{mismatch}, tile {TILE_ROWS} x {k_slice_for(dtype)} x {PROBE_SLICES} slices, N {n}"
                )
    return [(a, failures[a]) for a in ASSUMPTIONS if a in failures]


def _mismatches(dtype: torch.dtype, device: torch.device, n: int):
    """Yield (assumption, '' if it held else what differed) for probe shapes with N = n."""
    x, w, noise = _probe_inputs(dtype, device, n)
    half = TILE_ROWS // 2
    ref = _measure(x, w)  # (TILE_ROWS, N): one full tile of probe rows
    yield "other rows", _differ(_measure(x[:half], w), ref[:half], "zero-padded rows")
    mixed = noise.clone()
    mixed[::2] = x[::2]
    yield "other rows", _differ(_measure(mixed, w)[::2], ref[::2], "large rows in between")
    yield "row position", _differ(_measure(x.flip(0), w).flip(0), ref, "rows reversed")
    second = _measure(torch.cat([noise, x]), w)[TILE_ROWS:]
    yield "row position", _differ(second, ref, "in the second tile")
    if device.type == "cpu":
        current = torch.get_num_threads()
        for threads in (t for t in THREAD_COUNTS if t != current):
            got = _measure(x, w, threads)
            yield "thread count", _differ(got, ref, f"{threads} vs {current} threads")
    yield "weight address", _differ(_measure(x, _moved(w)), ref, "weight one element further on")


def _probe_inputs(dtype: torch.dtype, device: torch.device, n: int):
    g = torch.Generator().manual_seed(15)
    k = k_slice_for(dtype) * PROBE_SLICES + REMAINDER_COLUMNS
    x = torch.randn(TILE_ROWS, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    noise = torch.randn(TILE_ROWS, k, generator=g) * 1e3  # fits fp16 too
    return (t.to(device=device, dtype=dtype) for t in (x, w, noise))


def _moved(w: torch.Tensor) -> torch.Tensor:
    """The same values at an address one element further on (a fresh, shifted storage)."""
    flat = w.new_empty(w.numel() + 1)
    moved = flat[1:].view(w.shape)
    moved.copy_(w)
    return moved


def _differ(got: torch.Tensor, want: torch.Tensor, case: str) -> str:
    if torch.equal(got, want):
        return ""
    rows = int((got != want).any(dim=-1).sum())
    return f"{case}: {rows} of {want.shape[0]} rows differ"


@cache
def _machine(device_type: str) -> str:
    if device_type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_name()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown CPU"
