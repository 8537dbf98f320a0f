"""Fail closed: every (backend, op, dtype) is row-invariant, or it raises NonInvariantDtypeError.

For every backend available here (cpp, native; triton under Triton's interpreter), every
op of the registry and every floating dtype (fp32, bf16, fp16, fp64), the op `get_op`
returns either
- computes a row (a token, a sequence, an element) alone with the bits the same row has
  inside a larger batch (torch.equal; garbage in the other rows where a layout has
  padding), or
- raises NonInvariantDtypeError naming the op, the backend, the dtype and the opt-in
  (PlatformInvarianceError, its subclass, where native's platform probe refuses the dtype
  on this machine: native's GEMM ops and attention, and cpp's attention in fp16 / fp64,
  which runs native's forward),
and `get_op(..., allow_non_invariant=True)` runs every combination, with exactly the
strict op's bits wherever the strict op runs. Which combinations refuse is the table in
docs/backends.md: `REFUSED` below, plus the native probe's verdict here. The guard itself (the
opt-in's twin, the order of the checks, the device check): tests/kernels/common/test_op.py;
the error types: tests/kernels/test_errors.py.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from rl_engine.kernels import OP_NAMES, NonInvariantDtypeError, get_op
from tests.helpers.triton_marks import TRITON_MARKS

DTYPES = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp64": torch.float64,
}
# The ops that run a GEMM on a library (cpp's opt-in torch GEMM, native's probed tiles).
GEMM_OPS = ("linear", "lm_head", "linear_logp", "moe_router", "moe_experts")
# What each backend refuses by design (docs/backends.md): cpp's kernels serve fp32 and bf16;
# its fp64 / fp16 GEMM would be a padded torch GEMM whose rows follow the batch.
REFUSED = {("cpp", op, dtype) for op in GEMM_OPS for dtype in ("fp16", "fp64")}

# What runs on native's fixed-shape library GEMMs, refused wherever native's probe refuses the
# dtype: native's GEMM ops and attention (torch.bmm), cpp's attention in native's dtypes.
PROBED = {("native", op, dtype) for op in (*GEMM_OPS, "attention") for dtype in DTYPES} | {
    ("cpp", "attention", dtype) for dtype in ("fp16", "fp64")
}


probe_module = importlib.import_module("rl_engine.kernels.native.platform_probe")


def _refused(backend: str, op: str, dtype: str) -> bool:
    """By design (REFUSED), or measured: PROBED where this machine's probe refuses the dtype."""
    if (backend, op, dtype) in PROBED:
        return not probe_module.probe(DTYPES[dtype], "cpu").accepted
    return (backend, op, dtype) in REFUSED


# ----------------------------------------------------------------------------- one row alone vs in a batch


@dataclass(frozen=True)
class Case:
    """A row's result computed alone and inside a batch (both return just that row)."""

    alone: Callable
    in_batch: Callable


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _rows_case(call, pool, row: int) -> Case:
    """`call(op, rows)` on the row alone and on the whole pool."""
    return Case(
        alone=lambda op: _first(call(op, pool[row : row + 1])),
        in_batch=lambda op: _pick(call(op, pool), row),
    )


def _first(out):
    return _pick(out, 0)


def _pick(out, row):
    return tuple(t[row] for t in out) if isinstance(out, tuple) else out[row]


def _embedding(dtype):
    w = _randn(50, 16, dtype=dtype, seed=1)
    ids = torch.randint(0, 50, (70,), generator=torch.Generator().manual_seed(2))
    return _rows_case(lambda op, rows: op(rows, w), ids, 5)


def _projection(dtype):
    # 70 rows: native's second 64-row tile is part of the batch
    pool = _randn(70, 40, dtype=dtype, seed=3)
    w, b = _randn(24, 40, dtype=dtype, seed=4, scale=0.2), _randn(24, dtype=dtype, seed=5)
    return _rows_case(lambda op, rows: op(rows, w, b), pool, 5)


def _rms_norm(dtype):
    pool, w = _randn(9, 40, dtype=dtype, seed=6), _randn(40, dtype=dtype, seed=7)
    return _rows_case(lambda op, rows: op(rows, w, 1e-6), pool, 4)


def _elementwise(dtype):
    x = _randn(300, dtype=dtype, seed=8, scale=4.0)
    return _rows_case(lambda op, rows: op(rows), x, 37)


def _log_softmax(dtype):
    return _rows_case(lambda op, rows: op(rows, 0.7), _randn(9, 50, dtype=dtype, seed=9), 4)


def _linear_logp(dtype):
    h, w = _randn(9, 16, dtype=dtype, seed=10), _randn(50, 16, dtype=dtype, seed=11, scale=0.3)
    t = torch.randint(0, 50, (9,), generator=torch.Generator().manual_seed(12))
    return Case(
        alone=lambda op: op(h[4:5], w, t[4:5], temperature=0.7)[0],
        in_batch=lambda op: op(h, w, t, temperature=0.7)[4],
    )


def _moe_router(dtype):
    pool, w = _randn(9, 16, dtype=dtype, seed=13), _randn(6, 16, dtype=dtype, seed=14)
    return _rows_case(lambda op, rows: op(rows, w, 2, renormalize=True), pool, 4)


def _moe_experts(dtype):
    h = _randn(9, 16, dtype=dtype, seed=15)
    gate_up = _randn(4, 16, 16, dtype=dtype, seed=16, scale=0.25)
    down = _randn(4, 16, 8, dtype=dtype, seed=17, scale=0.35)
    g = torch.Generator().manual_seed(18)
    idx = torch.stack([torch.randperm(4, generator=g)[:2] for _ in range(9)])
    weights = torch.rand(9, 2, generator=g).to(dtype)
    return Case(
        alone=lambda op: op(h[4:5], gate_up, down, idx[4:5], weights[4:5])[0],
        in_batch=lambda op: op(h, gate_up, down, idx, weights)[4],
    )


def _attention(dtype):
    """A 5-token sequence prefilled alone == the same sequence right-padded (garbage past its
    end) next to a 9-token one."""
    hq, hkv, d, lengths = 4, 2, 8, (5, 9)
    q, k, v = (_randn(2, h, 9, d, dtype=dtype, seed=19 + i) for i, h in enumerate((hq, hkv, hkv)))
    pos = torch.tensor([[0, 1, 2, 3, 4, -1, -1, -1, -1], list(range(9))])
    n = lengths[0]
    return Case(
        alone=lambda op: op(q[:1, :, :n], k[:1, :, :n], v[:1, :, :n], q_positions=pos[:1, :n])[0],
        in_batch=lambda op: op(q, k, v, q_positions=pos)[0, :, :n],
    )


CASES = {
    "embedding": _embedding,
    "linear": _projection,
    "lm_head": _projection,
    "rms_norm": _rms_norm,
    "silu": _elementwise,
    "sigmoid": _elementwise,
    "log_softmax": _log_softmax,
    "attention": _attention,
    "linear_logp": _linear_logp,
    "moe_router": _moe_router,
    "moe_experts": _moe_experts,
}


def _same_bits(a, b) -> bool:
    if isinstance(a, tuple):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


def _walk():
    params = []
    for backend in ("cpp", "native", "triton"):
        marks = TRITON_MARKS if backend == "triton" else []
        for op in OP_NAMES:
            for dtype in DTYPES:
                case_id = f"{backend}-{op}-{dtype}"
                params.append(pytest.param(backend, op, dtype, marks=marks, id=case_id))
    return params


@pytest.mark.parametrize(("backend", "op_name", "dtype"), _walk())
def test_every_op_is_row_invariant_or_refuses_by_name(backend, op_name, dtype):
    case = CASES[op_name](DTYPES[dtype])
    strict = get_op(op_name, "cpu", backend=backend)
    opted_in = get_op(op_name, "cpu", backend=backend, allow_non_invariant=True)
    with torch.no_grad():
        if _refused(backend, op_name, dtype):
            for run in (case.alone, case.in_batch):
                with pytest.raises(NonInvariantDtypeError) as err:
                    run(strict)
                message = str(err.value)
                dtype_name = str(DTYPES[dtype]).removeprefix("torch.")
                for named in (repr(op_name), repr(backend), dtype_name):
                    assert named in message, message
                assert "allow_non_invariant=True" in message, message
            alone, in_batch = case.alone(opted_in), case.in_batch(opted_in)  # the opt-in runs it
            assert _first_tensor(alone).dtype == _first_tensor(in_batch).dtype
            return
        alone = case.alone(strict)
        assert _same_bits(case.in_batch(strict), alone), f"{backend} {op_name} {dtype}"
        assert _same_bits(case.alone(opted_in), alone), "the opt-in changed an invariant op's bits"


def _first_tensor(out):
    return out[0] if isinstance(out, tuple) else out
