"""The cpp linear_logp (cpp/linear_logp.py): chunked log_softmax(lm_head(h) / T) at the targets.

Chain: linear_logp(h, W, targets) == log_softmax(lm_head(h) / T) materialised at once and
gathered, torch.equal, across several chunks (a vocabulary large enough for 48-row chunks),
fp32 and bf16, ignored targets 0; accurate against fp64. Chunks are a whole number of
ROW_ALIGN rows between ROW_ALIGN and MAX_CHUNK_ROWS. Negative control: plain F.linear logits
change bits with the chunk (M = 1 vs all rows).
"""

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.cpp.linear import linear_forward
from rl_engine.kernels.cpp.linear_logp import (
    CHUNK_ELEMENTS,
    MAX_CHUNK_ROWS,
    ROW_ALIGN,
    chunk_logprobs,
    chunk_rows_for,
    linear_logp,
)
from rl_engine.kernels.native.log_softmax import log_softmax_forward
from tests.helpers.invariance import plain_linear_depends_on_the_chunk

VOCAB = 160_000  # 14M logits / 160k = 91 rows -> chunks of 48


def _case(rows, dtype=torch.float32, vocab=VOCAB, k=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(vocab, k, generator=g) / k**0.5).to(dtype)
    return h, w, torch.randint(0, vocab, (rows,), generator=g)


def test_chunks_are_whole_row_blocks_within_bounds():
    assert chunk_rows_for(VOCAB) == ROW_ALIGN
    assert chunk_rows_for(49152) == CHUNK_ELEMENTS // 49152 // ROW_ALIGN * ROW_ALIGN == 288
    assert chunk_rows_for(1) == chunk_rows_for(0) == MAX_CHUNK_ROWS // ROW_ALIGN * ROW_ALIGN
    assert chunk_rows_for(10**9) == ROW_ALIGN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunked_logprobs_equal_materialised_logits(dtype):
    h, w, targets = _case(100, dtype)  # three chunks: 48, 48, 4 rows
    targets[5] = -100
    got = linear_logp(h, w, targets, temperature=0.8)
    full = log_softmax_forward(linear_forward(h, w, None, torch.float32), 0.8)
    want = full.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    want[5] = 0
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert torch.equal(chunk_logprobs(h[:3], w, None, 0.8), full[:3])
    assert get_op("linear_logp", "cpu") is linear_logp


def test_negative_control_plain_linear_logits_change_with_the_chunk():
    assert plain_linear_depends_on_the_chunk(lambda k: _case(8, vocab=4096, k=k)[:2])


def test_logprobs_are_accurate_against_float64():
    h, w, targets = _case(30, vocab=5000)
    got = linear_logp(h, w, targets)
    want = torch.log_softmax(h.double() @ w.double().t(), dim=-1).gather(-1, targets[:, None])
    assert torch.allclose(got.double(), want[:, 0], rtol=1e-5, atol=1e-5)


def test_bad_targets_are_named():
    h, w, targets = _case(4, vocab=10)
    with pytest.raises(ValueError, match="targets out of range: min 0, max 10"):
        linear_logp(h, w, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(ValueError, match="temperature must be a finite number > 0, got 0.0"):
        linear_logp(h, w, targets, temperature=0)
