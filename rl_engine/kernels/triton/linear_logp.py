"""Fused, chunked per-token logprobs on the GPU: log_softmax(lm_head(hidden) / T) gathered at the targets.

Forward walks the tokens in chunks, so at most `chunk_rows x V` logits exist at
a time. Each chunk runs the very same kernels as the triton `lm_head` and
`log_softmax` ops the rollout engine calls on its decode batch (the persistent
fixed-order matmul and the one-program-per-row log-softmax); both are
row-invariant, so fused == unfused bitwise, whatever the chunk size. Backward
recomputes each chunk's softmax with those kernels and finishes with plain
torch GEMMs (deterministic): d logp[t] / d logits = (onehot(t) - softmax) / T.
Those loops, the autograd.Function and the op's checks are shared by every
backend (rl_engine/kernels/common/linear_logp.py); this file supplies the chunk.
With `spans=` / `sink=` the shared layout-invariant backward runs around
`_matmul.exact_gemm` (common/linear_logp_sequences.py).
"""

from __future__ import annotations

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.linear_logp import linear_logp_op
from rl_engine.kernels.triton._common import SERVING
from rl_engine.kernels.triton._matmul import BLOCK_M, exact_gemm, fixed_order_matmul
from rl_engine.kernels.triton.log_softmax import log_softmax_forward

# Logits held at once, in elements: 16M = 64 MiB per fp32 buffer (logits and logprobs).
# Only memory and speed depend on it, never the bits.
CHUNK_ELEMENTS = 16 * 1024 * 1024


def chunk_rows_for(vocab_size: int) -> int:
    """Rows per chunk: a multiple of the matmul's row tile, at least one tile."""
    rows = CHUNK_ELEMENTS // max(vocab_size, 1)
    return max(BLOCK_M, rows // BLOCK_M * BLOCK_M)


def chunk_logprobs(h, weight, bias, temperature):
    logits = fixed_order_matmul(h, weight, bias, out_dtype=at_least_fp32(h.dtype))  # (n, V)
    return log_softmax_forward(logits, temperature)  # (n, V) fp32


linear_logp = linear_logp_op(chunk_logprobs, chunk_rows_for, SERVING, __name__, exact_gemm)
