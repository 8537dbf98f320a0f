"""The native linear_logp (native/linear_logp.py): chunked log_softmax(lm_head(h) / T) at targets.

Chain: linear_logp(h, W, targets) == log_softmax(lm_head(h) / T) gathered at the targets,
materialised at once, torch.equal, across several chunks (a vocabulary large enough for
64-row chunks); accurate against fp64. The chunk size is a whole number of 64-row tiles
between 64 and 1024. Negative control: plain F.linear logits change bits with the chunk
(M = 1 vs all rows). The bit-level checks skip where the platform probe refuses the dtype;
the opted-in op's accuracy is checked on every CPU.
"""

import pytest
import torch

import rl_engine.kernels.native._tiles as tiles
from rl_engine.kernels import get_op
from rl_engine.kernels.native.linear import linear_forward
from rl_engine.kernels.native.linear_logp import (
    MAX_CHUNK_ROWS,
    chunk_logprobs,
    chunk_rows_for,
    linear_logp,
)
from rl_engine.kernels.native.log_softmax import log_softmax_forward
from tests.helpers.invariance import plain_linear_depends_on_the_chunk, skip_if_refused

VOCAB = 70_000  # 4M logits / 70k = 59 rows -> chunks of one 64-row tile


def _case(rows, vocab=VOCAB, k=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, k, generator=g)
    w = torch.randn(vocab, k, generator=g) / k**0.5
    return h, w, torch.randint(0, vocab, (rows,), generator=g)


def test_chunks_are_whole_tiles_within_bounds():
    assert chunk_rows_for(VOCAB) == tiles.TILE_ROWS
    assert chunk_rows_for(49152) == tiles.TILE_ROWS  # 85 rows, rounded down to a tile
    assert chunk_rows_for(10_000) == 384  # 419 rows -> 6 tiles
    assert chunk_rows_for(1) == chunk_rows_for(0) == MAX_CHUNK_ROWS
    assert chunk_rows_for(10**9) == tiles.TILE_ROWS


def test_chunked_logprobs_equal_materialised_logits():
    skip_if_refused("native", torch.float32)
    h, w, targets = _case(150)  # three chunks: 64, 64, 22 rows
    got = linear_logp(h, w, targets, temperature=0.8)
    full = log_softmax_forward(linear_forward(h, w, None, torch.float32), 0.8)
    assert torch.equal(got, full.gather(-1, targets[:, None])[:, 0])
    assert torch.equal(chunk_logprobs(h[:5], w, None, 0.8), full[:5])


def test_negative_control_plain_linear_logits_change_with_the_chunk():
    assert plain_linear_depends_on_the_chunk(lambda k: _case(8, vocab=4096, k=k)[:2])


def test_opted_in_op_is_accurate_on_every_cpu():
    op = get_op("linear_logp", "cpu", backend="native", allow_non_invariant=True)
    h, w, targets = _case(70)
    targets[3] = -100
    got = op(h, w, targets, temperature=0.8)
    want = torch.log_softmax(h.double() @ w.double().t() / 0.8, dim=-1)
    want = want.gather(-1, targets.clamp(min=0)[:, None])[:, 0]
    assert got.dtype == torch.float32 and got[3] == 0
    keep = targets != -100
    assert torch.allclose(got[keep].double(), want[keep], rtol=1e-5, atol=1e-5)


def test_bad_targets_are_named():
    h, w, targets = _case(4, vocab=10)
    with pytest.raises(ValueError, match="targets shape \\(3,\\) must equal hidden's leading"):
        linear_logp(h, w, targets[:3])
    with pytest.raises(ValueError, match="targets out of range: min 0, max 10"):
        linear_logp(h, w, torch.tensor([0, 1, 2, 10]))
    with pytest.raises(TypeError, match="targets must be a torch.Tensor"):
        linear_logp(h, w, [0, 1, 2, 3])
