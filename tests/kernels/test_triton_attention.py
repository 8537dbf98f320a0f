"""Triton attention: the native op's contract, and a row's bits fixed by its position alone.

Chain checked, always with torch.equal: prefill of a sequence alone
== inside a right-padded aligned batch == inside a left-padded batch
(k_positions) with garbage in every padding slot == decode of each position
against a KV cache read through kv_index (rows in any order, caches longer than
needed, finite garbage past each position) == chunked prefill. On the
interpreter the tiles are 16 queries x 32 keys and a KV split is 4 blocks
(128 positions), so the longest sequences here (130) cross a split with a remainder;
one test runs the GPU's constants. Negative control: a KV split chosen from the query count (as
flash-decoding heuristics do) breaks decode == prefill.
Accuracy and gradients against a plain fp64 reference (tolerance).
"""

import importlib

import pytest
import torch

from rl_engine.kernels import get_op
from tests.helpers.triton_marks import DEVICE, TRITON_MARKS, dtypes_keeping

pytestmark = TRITON_MARKS
DTYPES = [torch.float32, torch.bfloat16]
attn_module = importlib.import_module("rl_engine.kernels.triton.attention")


def attention(*args, **kwargs):
    return get_op("attention", DEVICE, backend="triton")(*args, **kwargs)


def _seq(n, hq=4, hkv=2, d=24, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(h, n, d, generator=g).to(dtype).to(DEVICE) for h in (hq, hkv, hkv))


def _alone(seq):
    q, k, v = seq
    pos = torch.arange(q.shape[1], device=DEVICE)[None]
    return attention(q[None], k[None], v[None], q_positions=pos)[0]


def _reference(q, k, v):
    """fp64 causal GQA softmax attention of one sequence: (Hq, L, D)."""
    g = q.shape[0] // k.shape[0]
    q, k, v = q.double(), k.double().repeat_interleave(g, 0), v.double().repeat_interleave(g, 0)
    s = q @ k.transpose(1, 2) * q.shape[-1] ** -0.5
    n = q.shape[1]
    s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


def _garbage(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 1e4).to(dtype).to(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES)
def test_accuracy_gqa_and_output_dtype(dtype):
    seq = _seq(130, hq=6, hkv=2, dtype=dtype)  # crosses a KV split on the interpreter
    out = _alone(seq)
    assert out.dtype == dtype and out.shape == seq[0].shape
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), _reference(*seq), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", dtypes_keeping(torch.float32))
def test_padding_layouts_and_batch_neighbours_do_not_change_a_row(dtype):
    lengths = [37, 130, 5, 64]
    seqs = [_seq(n, dtype=dtype, seed=i) for i, n in enumerate(lengths)]
    alone = [_alone(s) for s in seqs]
    total = max(lengths) + 3
    for left in (False, True):
        B = len(seqs)
        q = _garbage((B, 4, total, 24), dtype, 1)
        k, v = _garbage((B, 2, total, 24), dtype, 2), _garbage((B, 2, total, 24), dtype, 3)
        qpos = torch.full((B, total), -1, dtype=torch.long, device=DEVICE)
        for b, (sq, sk, sv) in enumerate(seqs):
            n = sq.shape[1]
            cols = slice(total - n, total) if left else slice(0, n)
            q[b, :, cols], k[b, :, cols], v[b, :, cols] = sq, sk, sv
            qpos[b, cols] = torch.arange(n, device=DEVICE)
        # left padding needs k_positions; right padding may use the aligned layout
        kpos = qpos if left else None
        out = attention(q, k, v, q_positions=qpos, k_positions=kpos)
        for b, n in enumerate(lengths):
            cols = slice(total - n, total) if left else slice(0, n)
            assert torch.equal(out[b, :, cols], alone[b]), f"left={left}, sequence {b}"
            pad = torch.ones(total, dtype=torch.bool, device=DEVICE)
            pad[cols] = False
            assert torch.equal(out[b][:, pad], torch.zeros_like(out[b][:, pad]))


@pytest.mark.parametrize("dtype", dtypes_keeping(torch.bfloat16))
def test_decode_from_a_cache_equals_prefill(dtype):
    """Every decode row (one query, keys read in place through kv_index) == its prefill row."""
    seqs = [_seq(n, dtype=dtype, seed=i) for i, n in enumerate([130, 40, 33])]
    alone = [_alone(s) for s in seqs]
    positions = [(0, 0), (0, 31), (0, 32), (0, 127), (0, 128), (0, 129), (1, 17), (2, 32)]
    cap, slots = 140, 5
    kc = _garbage((slots, 2, cap, 24), torch.float32, 4).clamp(-1e4, 1e4)  # finite garbage
    vc = _garbage((slots, 2, cap, 24), torch.float32, 5).clamp(-1e4, 1e4)
    slot_of = [3, 0, 4]
    for s, (_, k, v) in zip(slot_of, seqs):
        kc[s, :, : k.shape[1]], vc[s, :, : v.shape[1]] = k.float(), v.float()
    kc, vc = kc.to(dtype), vc.to(dtype)
    order = torch.randperm(len(positions)).tolist()  # decode rows in any order
    q = torch.stack([seqs[positions[i][0]][0][:, positions[i][1]] for i in order])[:, :, None]
    qpos = torch.tensor([[positions[i][1]] for i in order], device=DEVICE)
    kv_index = torch.tensor([slot_of[positions[i][0]] for i in order], device=DEVICE)
    out = attention(q, kc, vc, q_positions=qpos, kv_index=kv_index)
    for row, i in enumerate(order):
        b, p = positions[i]
        assert torch.equal(out[row, :, 0], alone[b][:, p]), f"sequence {b}, position {p}"


def test_chunked_prefill_equals_prefill():
    seq = _seq(130)
    alone = _alone(seq)
    q, k, v = seq
    for s, e in [(0, 20), (20, 129), (129, 130)]:
        pos = torch.arange(s, e, device=DEVICE)[None]
        out = attention(q[None, :, s:e], k[None, :, :e], v[None, :, :e], q_positions=pos)
        assert torch.equal(out[0], alone[:, s:e]), (s, e)


def test_gpu_constants_keep_decode_equal_to_prefill(monkeypatch):
    """The GPU's tiles (64 queries, 64 keys, 16-block splits) on the interpreter."""
    for name, value in (("BLOCK_M", 64), ("BLOCK_N", 64), ("SPLIT_BLOCKS", 16)):
        monkeypatch.setattr(attn_module, name, value)
    seq = _seq(70, hq=2, hkv=1, d=16)
    alone = _alone(seq)
    q, k, v = seq
    for p in (0, 63, 64, 69):
        out = attention(q[None, :, p : p + 1], k[None], v[None], q_positions=torch.tensor([[p]]))
        assert torch.equal(out[0, :, 0], alone[:, p]), p


def test_negative_control_split_size_that_follows_the_query_count(monkeypatch):
    """A decode that picked its own KV split (flash-decoding heuristics) would not equal prefill."""
    seq = _seq(130, hq=2, hkv=1, d=16)
    prefill = _alone(seq)
    q, k, v = seq
    monkeypatch.setattr(attn_module, "SPLIT_BLOCKS", 1)
    decode = attention(q[None, :, 129:130], k[None], v[None], q_positions=torch.tensor([[129]]))
    assert not torch.equal(decode[0, :, 0], prefill[:, 129])


def test_validation_errors_name_the_tensor():
    q, k, v = _seq(8)
    pos = torch.arange(8)[None]
    with pytest.raises(ValueError, match="q heads"):
        attention(
            q[None], k[None, :1].repeat(1, 3, 1, 1), v[None, :1].repeat(1, 3, 1, 1), q_positions=pos
        )
    with pytest.raises(ValueError, match="same position twice"):
        attention(q[None], k[None], v[None], q_positions=torch.zeros(1, 8, dtype=torch.long))


def test_backward_matches_fp64_reference_and_is_deterministic():
    seq = _seq(40, hq=4, hkv=2, d=16)
    grads = []
    for _ in range(2):
        q, k, v = (t.clone().requires_grad_() for t in seq)
        _alone((q, k, v)).pow(2).sum().backward()
        grads.append([t.grad for t in (q, k, v)])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    q, k, v = (t.double().clone().requires_grad_() for t in seq)
    _reference(q, k, v).pow(2).sum().backward()
    for ours, ref in zip(grads[0], (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(ours.double(), ref, atol=1e-4, rtol=1e-4)


def test_decode_padding_row_is_exactly_zero_and_leaves_the_others_alone():
    seq = _seq(40)
    alone = _alone(seq)
    q, k, v = seq
    qd = torch.stack([q[:, 39], q[:, 7]])[:, :, None]
    kc, vc = torch.stack([k, k]), torch.stack([v, v])
    out = attention(qd, kc, vc, q_positions=torch.tensor([[39], [-1]], device=DEVICE))
    assert torch.equal(out[0, :, 0], alone[:, 39])
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype", dtypes_keeping(torch.bfloat16))
def test_tile_groups_do_not_change_the_bits(dtype, monkeypatch):
    """The split partials of one group of tiles at a time: one tile a group == all at once."""
    lengths = (130, 40)  # the first crosses a KV split (128 positions on the interpreter)
    T = max(lengths)
    q = _garbage((2, 2, T, 24), dtype, 1)  # 2 query heads to 1 KV head: a group costs per head
    k, v = _garbage((2, 1, T, 24), dtype, 2), _garbage((2, 1, T, 24), dtype, 3)
    pos = torch.full((2, T), -1, dtype=torch.long, device=DEVICE)
    for i, n in enumerate(lengths):
        pos[i, :n] = torch.arange(n, device=DEVICE)
    whole = attention(q, k, v, q_positions=pos)
    monkeypatch.setattr(attn_module, "PARTIALS_BYTES", 1)  # one tile per group
    assert torch.equal(attention(q, k, v, q_positions=pos), whole)
    # 5 of the 12 tiles a group: 2 heads x 2 splits x 16 rows x (32 + 2) fp32 a tile
    monkeypatch.setattr(attn_module, "PARTIALS_BYTES", 5 * 2 * 2 * 16 * (32 + 2) * 4)
    assert torch.equal(attention(q, k, v, q_positions=pos), whole)


def test_split_partials_are_bounded_not_quadratic():
    """2 sequences of 8192 tokens, 32 heads, D 128 (2.2 GB of partials with the GPU's constants
    before the tiles were grouped, O(L^2)): the launches are only recorded, never run."""
    from rl_engine.kernels.triton._launch import capture_launches

    B, Hq, Hkv, L, D = 2, 32, 8, 8192, 128
    q = torch.empty(B, Hq, L, D, dtype=torch.bfloat16, device=DEVICE)
    k, v = (torch.empty(B, Hkv, L, D, dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    pos = torch.arange(L, device=DEVICE).expand(B, L)
    with torch.no_grad(), capture_launches() as launches:
        attn_module.attention_forward(q, k, v, pos, None, D**-0.5, None)
    splits = [la for la in launches if la.variant.startswith("split")]
    n_tiles = B * (L // attn_module.BLOCK_M)
    assert sum(la.grid[0] for la in splits) == n_tiles  # every tile, once
    n_split = -(-L // (attn_module.BLOCK_N * attn_module.SPLIT_BLOCKS))
    one_tile = Hq * n_split * attn_module.BLOCK_M * (D + 2) * 4
    for la in launches:
        part_acc, part_ml = la.args[4:6] if la.variant.startswith("split") else la.args[1:3]
        held = (part_acc.numel() + part_ml.numel()) * part_acc.element_size()
        assert held <= max(attn_module.PARTIALS_BYTES, one_tile)
        assert held * 4 < n_tiles * one_tile  # what one buffer for every tile would hold
    assert {la.variant for la in launches} == {"split_d128", "combine_d128"}
