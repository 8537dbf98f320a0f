"""Fused, chunked per-token logprobs: log_softmax(lm_head(hidden) / T) gathered at the targets.

Forward walks the tokens in chunks, so at most `chunk_rows x V` logits exist at a
time (O(chunk x V) extra memory instead of O(N x V)). Each chunk calls the very
same `lm_head` and `log_softmax` ops the rollout engine calls on its decode
batch; both are row-invariant, so the result is bitwise equal to materialising
all logits, whatever the chunk size. Backward recomputes each chunk's softmax:
d logp[t] / d logits = (onehot(t) - softmax) / T.

The chunk loops, the autograd.Function and the argument checks are shared by
every backend (rl_engine/kernels/common/linear_logp.py); this file supplies the
chunk (`_chunk_logprobs`) and the chunk size (`chunk_rows_for`).
"""

from __future__ import annotations

from functools import partial

from rl_engine.kernels.common.linear_logp import (
    chunked_logp_backward,
    chunked_logp_forward,
    linear_logp_function,
    linear_logp_op,
    validate,
)
from rl_engine.kernels.native._gemm import TILE_ROWS
from rl_engine.kernels.native.linear import lm_head
from rl_engine.kernels.native.log_softmax import log_softmax

# Logits held at once, in elements: 4M = 16 MiB per fp32 buffer. Smaller chunks re-read
# the whole LM-head weight more often (slower); larger ones keep more memory. 4M met
# both targets at 4096 tokens x 49152 vocab (see docs/benchmarks.md).
CHUNK_ELEMENTS = 4 * 1024 * 1024
MAX_CHUNK_ROWS = 1024


def chunk_rows_for(vocab_size: int) -> int:
    """A whole number of GEMM row tiles (a partial tile would pay for its padding)."""
    rows = min(MAX_CHUNK_ROWS, CHUNK_ELEMENTS // max(vocab_size, 1))
    return max(TILE_ROWS, rows // TILE_ROWS * TILE_ROWS)


def _chunk_logprobs(h, weight, bias, temperature):
    return log_softmax(lm_head(h, weight, bias), temperature)  # (n, V) fp32


linear_logp_forward = partial(chunked_logp_forward, _chunk_logprobs, chunk_rows_for)
linear_logp_backward = partial(chunked_logp_backward, _chunk_logprobs, chunk_rows_for)
_LinearLogp = linear_logp_function(linear_logp_forward, linear_logp_backward, __name__)
_validate = validate
linear_logp = linear_logp_op(_LinearLogp)
