"""The cpp attention reading a paged KV cache in place (kv_index as a block table).

vLLM's CPU cache layout: (blocks, Hkv, block, 2D), a block's keys then its values; row b's
position j is row j % block of block table[b, j // block]. Chain: the block-table call ==
the same call on the keys gathered into the aligned layout (the path the plugin ran
before), torch.equal, fp32 and bf16, blocks of 32 and 128, decode and chunked prefill,
grouped-query heads, nan in every slot no query reads. Negative control: a table with two
blocks swapped (another key order) changes the rows that read them. Fail closed: native
refuses a block table, the autograd path refuses it, a block size the kernel cannot pack
and an entry outside the cache are named.
"""

import pytest
import torch

from rl_engine.kernels import get_op
from rl_engine.kernels.cpp.attention import attention

HQ, HKV, D, BLOCKS = 4, 2, 16, 48
SEQ_LENS = (1, 31, 32, 33, 130, 200)


def _cache(dtype, block, seed=0):
    """A vLLM-layout cache whose slots past every sequence's end hold nan; its halves and
    a block table of distinct shuffled blocks per row."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(BLOCKS, HKV, block, 2 * D, generator=g).to(dtype)
    width = -(-max(SEQ_LENS) // block)
    rows = len(SEQ_LENS)  # distinct blocks per row, shuffled
    table = torch.randperm(BLOCKS, generator=g)[: rows * width].view(rows, width)
    halves = cache.view(BLOCKS, HKV, 2 * block, D)
    keys, values = halves[:, :, :block], halves[:, :, block:]
    for b, n in enumerate(SEQ_LENS):  # garbage no query may read
        for j in range(n, width * block):
            keys[table[b, j // block], :, j % block] = float("nan")
            values[table[b, j // block], :, j % block] = float("nan")
    return keys, values, table


def _gathered(half, table):
    """(B, Hkv, width * block, D): each row's blocks in table order (the aligned layout)."""
    rows, width = table.shape
    _, heads, block, dim = half.shape
    picked = half[table].permute(0, 2, 1, 3, 4)
    return picked.reshape(rows, heads, width * block, dim).nan_to_num(0.0)


def _queries(dtype, q_len, seed=1):
    """q (B, Hq, q_len, D) at each sequence's last q_len positions (fewer: padding -1)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(len(SEQ_LENS), HQ, q_len, D, generator=g).to(dtype)
    pos = torch.stack([torch.arange(n - q_len, n) for n in SEQ_LENS])
    return q, pos.clamp(min=-1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("q_len", [1, 5])
def test_the_block_table_has_the_bits_of_the_gathered_keys(dtype, block, q_len):
    keys, values, table = _cache(dtype, block)
    q, pos = _queries(dtype, q_len)
    paged = attention(q, keys, values, q_positions=pos, kv_index=table)
    aligned = attention(q, _gathered(keys, table), _gathered(values, table), q_positions=pos)
    assert paged.dtype == dtype and paged.shape == q.shape
    assert not paged.isnan().any()
    assert torch.equal(paged, aligned)


def test_negative_control_another_block_order_changes_the_rows_that_read_it():
    keys, values, table = _cache(torch.float32, 32)
    q, pos = _queries(torch.float32, 1)
    swapped = table.clone()
    swapped[:, [0, 1]] = table[:, [1, 0]]
    paged = attention(q, keys, values, q_positions=pos, kv_index=table)
    other = attention(q, keys, values, q_positions=pos, kv_index=swapped)
    reads_two = torch.tensor([n > 32 for n in SEQ_LENS])
    assert not torch.equal(paged[reads_two], other[reads_two])


def test_native_and_autograd_refuse_a_block_table():
    keys, values, table = _cache(torch.float32, 32)
    q, pos = _queries(torch.float32, 1)
    native = get_op("attention", "cpu", backend="native", allow_non_invariant=True)
    with pytest.raises(ValueError, match="block table"):
        native(q, keys, values, q_positions=pos, kv_index=table)
    with pytest.raises(ValueError, match="forward-only"):
        attention(q.requires_grad_(True), keys, values, q_positions=pos, kv_index=table)


def test_bad_block_tables_are_named():
    keys, values, table = _cache(torch.float32, 32)
    q, pos = _queries(torch.float32, 1)
    with pytest.raises(ValueError, match=r"must lie in \[0, 48\)"):
        attention(q, keys, values, q_positions=pos, kv_index=table + BLOCKS)
    with pytest.raises(ValueError, match="rows"):
        attention(q, keys, values, q_positions=pos, kv_index=table[:2])
    with pytest.raises(ValueError, match="multiple of 16"):
        attention(q, keys[:, :, :24], values[:, :, :24], q_positions=pos, kv_index=table)
    with pytest.raises(RuntimeError, match="KV blocks"):
        attention(q, keys, values, q_positions=pos, kv_index=table[:, :2])
