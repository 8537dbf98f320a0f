"""Fused, chunked per-token logprobs on CPU: log_softmax(lm_head(hidden) / T) at the targets.

The shared chunked op (rl_engine/kernels/common/linear_logp.py) with this
backend's chunk: each chunk of tokens runs the kernels of the cpp `lm_head` (the
fixed-order GEMM, M-independent by construction) and `log_softmax` (the native
one), so the result is bitwise equal to materialising all logits, whatever the
chunk size. Only the chunk size is this backend's own: the GEMM
packs (streams) the whole LM-head weight once per call for a chunk of up to
480 rows, so chunks are a multiple of ROW_ALIGN rows and as large as the
memory target allows (CHUNK_ELEMENTS logits at a time).
"""

from __future__ import annotations

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.linear_logp import linear_logp_op
from rl_engine.kernels.cpp._serving import GEMM
from rl_engine.kernels.cpp.linear import exact_gemm, linear_forward
from rl_engine.kernels.native.log_softmax import log_softmax_forward

# Logits held at once, in elements: 14M = 56 MiB per fp32 buffer (298 rows at
# a 49152 vocabulary, rounded down to 288, a multiple of ROW_ALIGN); the op
# holds about three such buffers (logits, log_softmax, its temporaries): peak
# extra memory 0.11x of materialising 4096 x 49152 fp32 logits (16M: 0.126x,
# over the 1/8 target). A chunk of up to 480 rows (the GEMM's row block)
# packs each 256-column weight block once, in L2, so the weight is streamed
# once per chunk: larger chunks amortise it. ROW_ALIGN is a multiple of the
# 6-row register tile. Only speed and memory depend on these, never the bits.
CHUNK_ELEMENTS = 14 * 1024 * 1024
ROW_ALIGN = 48
MAX_CHUNK_ROWS = 1024


def chunk_rows_for(vocab_size: int) -> int:
    rows = min(MAX_CHUNK_ROWS, CHUNK_ELEMENTS // max(vocab_size, 1))
    return max(ROW_ALIGN, rows // ROW_ALIGN * ROW_ALIGN)


def chunk_logprobs(h, weight, bias, temperature):
    logits = linear_forward(h, weight, bias, at_least_fp32(h.dtype))  # `lm_head`: (n, V)
    return log_softmax_forward(logits, temperature)  # (n, V) fp32


linear_logp = linear_logp_op(chunk_logprobs, chunk_rows_for, GEMM, __name__, exact_gemm)
