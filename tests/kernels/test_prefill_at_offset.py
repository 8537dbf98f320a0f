"""attention: a prefill at an offset through a slot KV cache == full prefill == decode, row for row.

What an environment turn needs of the op: a sequence whose first L tokens' keys and values
already sit in its slot of an fp32 KV cache (an earlier prefill wrote the first ones, decodes
the rest) gets M more tokens (an observation, M = 1 and M > 1) by a prefill with q_positions
L..L+M-1 that reads its keys through kv_index. Its output rows must be torch.equal to (a) the
rows L..L+M-1 of a prefill of all L+M tokens at once and (b) M one-token decodes, while the
same call holds other sequences at other lengths: one decoding, one prefilling at offset 0.
Slots are shuffled, unused slots and the cache past each sequence's keys hold finite garbage.
Every backend: cpp and native, and triton (on the interpreter at tiny sizes without a GPU).
Negative control: plain SDPA's rows of a prefill at an offset differ from its full prefill's.
"""

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import get_op
from tests.helpers.kernels.attention import skip_if_attention_refused
from tests.helpers.triton_marks import DEVICE as TRITON_DEVICE
from tests.helpers.triton_marks import TRITON_MARKS

HQ, HKV, D = 4, 2, 24
CAP, SLOTS = 256, 5  # an fp32 cache of whole 128-position blocks, as the engine allocates
DTYPES = [torch.float32, torch.bfloat16]
# (cached length L, observation length M): a one-token observation; one inside a native query
# tile and key block; one that crosses a query tile and the 128-position key block (native)
# and KV split (triton's interpreter)
OFFSETS = [(30, 1), (40, 6), (126, 5)]
DECODE_AT, PREFILL_LENGTH = 70, 9  # the neighbours: one decoding, one prefilling at offset 0


def _cases():
    for backend in ("cpp", "native", "triton"):
        marks = TRITON_MARKS if backend == "triton" else ()
        for dtype in DTYPES:
            for L, M in OFFSETS:
                # the interpreter takes seconds a call: make test keeps fp32 and two offsets
                slow = backend == "triton" and (dtype == torch.bfloat16 or (L, M) == (40, 6))
                yield pytest.param(
                    backend,
                    dtype,
                    L,
                    M,
                    marks=[*marks, *([pytest.mark.exhaustive] if slow else [])],
                    id=f"{backend}-{str(dtype)[6:]}-L{L}-M{M}",
                )


def _device(backend: str) -> str:
    return TRITON_DEVICE if backend == "triton" else "cpu"


def _seq(n, dtype, device, seed):
    """(q, k, v) of one sequence: (Hq, n, D), (Hkv, n, D), (Hkv, n, D)."""
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(h, n, D, generator=g).to(dtype).to(device) for h in (HQ, HKV, HKV))


def _alone(attention, seq):
    """The prefill of the whole sequence at once: (Hq, n, D)."""
    q, k, v = seq
    pos = torch.arange(q.shape[1], device=q.device)[None]
    return attention(q[None], k[None], v[None], q_positions=pos)[0]


class _Cache:
    """An fp32 slot KV cache full of finite garbage; `write` puts a sequence's keys at positions
    [start, end) of its slot, as a prefill (several) or a decode (one) stores them."""

    def __init__(self, device, seed=3):
        g = torch.Generator().manual_seed(seed)
        self.k = (torch.randn(SLOTS, HKV, CAP, D, generator=g) * 1e4).to(device)
        self.v = (torch.randn(SLOTS, HKV, CAP, D, generator=g) * 1e4).to(device)

    def write(self, slot: int, seq, start: int, end: int) -> None:
        _, k, v = seq
        self.k[slot, :, start:end] = k[:, start:end].float()
        self.v[slot, :, start:end] = v[:, start:end].float()


def _decode(attention, cache: _Cache, seq, slot: int, p: int):
    """One decode step of position p through kv_index: (Hq, D)."""
    q = seq[0][None, :, p : p + 1]
    qpos = torch.tensor([[p]], device=q.device)
    kv_index = torch.tensor([slot], device=q.device)
    return attention(q, cache.k, cache.v, q_positions=qpos, kv_index=kv_index)[0, :, 0]


@pytest.mark.parametrize("backend,dtype,L,M", list(_cases()))
def test_prefill_at_an_offset_through_the_cache_equals_full_prefill_and_decode(
    backend, dtype, L, M
):
    device = _device(backend)
    skip_if_attention_refused(backend, dtype, device)  # native: where its platform probe refuses
    attention = get_op("attention", device, backend=backend)
    offset_seq = _seq(L + M, dtype, device, seed=1)
    decoding = _seq(DECODE_AT + 1, dtype, device, seed=2)
    fresh = _seq(PREFILL_LENGTH, dtype, device, seed=4)
    slot = {"offset": 3, "decoding": 0, "fresh": 4}  # shuffled; slots 1 and 2 unused

    cache = _Cache(device)
    # the offset sequence's history: a prefill of its first tokens, then decodes up to L
    first = L // 2
    cache.write(slot["offset"], offset_seq, 0, first)
    for p in range(first, L):
        cache.write(slot["offset"], offset_seq, p, p + 1)
    cache.write(slot["decoding"], decoding, 0, DECODE_AT + 1)
    # this step's new keys: the observation's M, the fresh prompt's, the decode's one
    cache.write(slot["offset"], offset_seq, L, L + M)
    cache.write(slot["fresh"], fresh, 0, PREFILL_LENGTH)

    # one mixed call: row 0 decodes, row 1 prefills at offset 0, row 2 prefills at offset L
    T = max(M, PREFILL_LENGTH)
    q = torch.zeros(3, HQ, T, D, dtype=dtype, device=device)
    qpos = torch.full((3, T), -1, dtype=torch.long, device=device)
    q[0, :, :1], qpos[0, 0] = decoding[0][:, DECODE_AT : DECODE_AT + 1], DECODE_AT
    q[1, :, :PREFILL_LENGTH] = fresh[0]
    qpos[1, :PREFILL_LENGTH] = torch.arange(PREFILL_LENGTH)
    q[2, :, :M], qpos[2, :M] = offset_seq[0][:, L:], torch.arange(L, L + M)
    kv_index = torch.tensor([slot["decoding"], slot["fresh"], slot["offset"]], device=device)
    out = attention(q, cache.k, cache.v, q_positions=qpos, kv_index=kv_index)

    full = _alone(attention, offset_seq)
    for j in range(M):
        row = f"position {L + j} of a prefill at offset {L}"
        assert torch.equal(out[2, :, j], full[:, L + j]), f"{row} != the full prefill"
        decoded = _decode(attention, cache, offset_seq, slot["offset"], L + j)
        assert torch.equal(out[2, :, j], decoded), f"{row} != its one-token decode"
    assert torch.equal(out[0, :, 0], _alone(attention, decoding)[:, DECODE_AT])
    assert torch.equal(out[1, :, :PREFILL_LENGTH], _alone(attention, fresh))
    padding = qpos < 0
    assert not out.transpose(1, 2)[padding].any(), "padding queries must give exact zeros"


@pytest.mark.parametrize("dtype", DTYPES)
def test_negative_control_sdpa_prefill_at_an_offset_differs(dtype):
    """Plain SDPA: a prefill of queries L..L+M-1 against keys 0..L+M-1 (the causal mask offset
    by L) differs from the same rows of its full prefill for some row, so the test above can
    fail."""
    q, k, v = (t[None] for t in _seq(300, dtype, "cpu", seed=11))
    k, v = (t.repeat_interleave(HQ // HKV, 1) for t in (k, v))  # GQA as plain heads
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    same = []
    for L, M in [(L, M) for L in range(1, 290, 13) for M in (1, 5)]:
        n = L + M
        mask = torch.ones(M, n, dtype=torch.bool).tril(L)  # query L + i sees keys 0..L + i
        out = F.scaled_dot_product_attention(q[:, :, L:n], k[:, :, :n], v[:, :, :n], mask)
        same.append(torch.equal(out[0], full[0, :, L:n]))
    assert not all(same), "SDPA became prefill-at-offset invariant: re-check the negative control"
