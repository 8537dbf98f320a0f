"""Fused, chunked per-token logprobs: log_softmax(lm_head(hidden) / T) gathered at the targets.

Forward walks the tokens in chunks, so at most `chunk_rows x V` logits exist at a
time (O(chunk x V) extra memory instead of O(N x V)). Each chunk runs the very
same kernels as the `lm_head` and `log_softmax` ops the rollout engine calls on
its decode batch; both are row-invariant, so the result is bitwise equal to
materialising all logits, whatever the chunk size. Backward recomputes each
chunk's softmax: d logp[t] / d logits = (onehot(t) - softmax) / T.

The chunk loops, the autograd.Function, the argument checks and the op are shared
by every backend (rl_engine/kernels/common/linear_logp.py); this file supplies the
chunk (`chunk_logprobs`) and the chunk size (`chunk_rows_for`).
"""

from __future__ import annotations

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.linear_logp import linear_logp_op
from rl_engine.kernels.native._serving import GEMM
from rl_engine.kernels.native._tiles import TILE_ROWS
from rl_engine.kernels.native.linear import exact_gemm, linear_forward
from rl_engine.kernels.native.log_softmax import log_softmax_forward

# Logits held at once, in elements: 4M = 16 MiB per fp32 buffer. Smaller chunks re-read
# the whole LM-head weight more often (slower); larger ones keep more memory. 4M met
# both targets at 4096 tokens x 49152 vocab (see docs/benchmarks.md).
CHUNK_ELEMENTS = 4 * 1024 * 1024
MAX_CHUNK_ROWS = 1024


def chunk_rows_for(vocab_size: int) -> int:
    """A whole number of GEMM row tiles (a partial tile would pay for its padding)."""
    rows = min(MAX_CHUNK_ROWS, CHUNK_ELEMENTS // max(vocab_size, 1))
    return max(TILE_ROWS, rows // TILE_ROWS * TILE_ROWS)


def chunk_logprobs(h, weight, bias, temperature):
    logits = linear_forward(h, weight, bias, at_least_fp32(h.dtype))  # `lm_head`: (n, V)
    return log_softmax_forward(logits, temperature)  # (n, V) fp32


linear_logp = linear_logp_op(chunk_logprobs, chunk_rows_for, GEMM, __name__, exact_gemm)
