"""SlotKVCache: the aligned slot layout (cache row j of a slot = sequence position j).

What it checks: a bound batch writes each real query token at its own slot and position and
nothing for padding queries; `update` gathers any slots (a view for contiguous ones),
`update_slots` hands back the whole buffers; a packed forward stores only; `copy_rows` copies
positions [0, length) of one slot into others in every layer; the engine passes the cache to
every attention layer once per forward; every misuse raises naming the bad argument.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout import RolloutEngine, SamplingParams, SlotKVCache
from tests.helpers.rollout.common import patched_model


def test_the_cache_kwarg_reaches_every_attention_layer(monkeypatch):
    # transformers passes `rl_kv_cache` through the decoder down to the attention function:
    # every layer stores its keys once per forward (update() or update_slots()), in layer order.
    calls = []
    original = SlotKVCache._store

    def spy(self, layer_idx, key, value):
        calls.append((layer_idx, tuple(key.shape)))
        return original(self, layer_idx, key, value)

    monkeypatch.setattr(SlotKVCache, "_store", spy)
    model = patched_model("tiny-qwen2")
    engine = RolloutEngine(model, device="cpu", max_batch_size=2, progress=False)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_new_tokens=3))
    layers = model.config.num_hidden_layers
    forwards = engine.last_stats.prefill_forwards + engine.last_stats.decode_forwards
    assert [i for i, _ in calls] == list(range(layers)) * forwards
    head_dim = model.config.hidden_size // model.config.num_attention_heads
    assert calls[0][1] == (
        2,
        model.config.num_key_value_heads,
        3,
        head_dim,
    )  # prefill, right-padded
    assert calls[-1][1][2] == 1  # decode: one query per sequence


def test_slot_cache_is_aligned_and_gathers_any_slots():
    cache = SlotKVCache(num_slots=3, capacity=8, device="cpu")
    key = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)  # (B, Hkv, Tq, D)
    cache.bind(torch.tensor([2, 0]), torch.tensor([[0, 1, 2], [0, 1, -1]]))
    keys, values, q_pos = cache.update(0, key, -key)
    assert keys.shape == (2, 1, 3, 2) and torch.equal(q_pos, torch.tensor([[0, 1, 2], [0, 1, -1]]))
    assert torch.equal(keys[0], key[0]) and torch.equal(keys[1, :, :2], key[1, :, :2])
    assert torch.equal(keys[1, :, 2], torch.zeros(1, 2))  # the padding query wrote nothing
    assert torch.equal(values, -keys)
    cache.bind(torch.tensor([0, 1]), torch.tensor([[2], [0]]))  # contiguous slots: a view
    step = torch.full((2, 1, 1, 2), 7.0)
    keys, _, _ = cache.update(0, step, step)
    assert keys.shape == (2, 1, 3, 2)
    assert torch.equal(keys[0, :, :2], key[1, :, :2]) and torch.equal(
        keys[0, :, 2], torch.full((1, 2), 7.0)
    )
    cache.unbind()
    with pytest.raises(RuntimeError, match="bind"):
        cache.update(0, step, step)
    with pytest.raises(ValueError, match="holds 8 positions"):
        cache.bind(torch.tensor([0]), torch.tensor([[8]]))


def test_copy_rows_copies_the_prompt_positions_of_every_layer():
    cache = SlotKVCache(num_slots=3, capacity=8, device="cpu")
    with pytest.raises(RuntimeError, match="no forward"):
        cache.copy_rows(0, [1], 2)
    key = torch.arange(1 * 2 * 3 * 4, dtype=torch.float32).view(1, 2, 3, 4)  # (B, Hkv, Tq, D)
    cache.bind(torch.tensor([0]), torch.tensor([[0, 1, 2]]))
    for layer in (0, 1):
        cache.update_slots(layer, key + layer, -key)
    cache.unbind()
    cache.copy_rows(0, [2, 1], 2)
    for layer in (0, 1):
        keys, values = cache._keys[layer], cache._values[layer]
        for slot in (1, 2):
            assert torch.equal(keys[slot, :, :2], key[0, :, :2] + layer)
            assert torch.equal(values[slot, :, :2], -key[0, :, :2])
            assert torch.equal(keys[slot, :, 2:], torch.zeros(2, 6, 4))  # past length: untouched
    with pytest.raises(ValueError, match="distinct slots"):
        cache.copy_rows(0, [0], 2)
    with pytest.raises(ValueError, match="length"):
        cache.copy_rows(0, [1], 9)


def test_a_packed_forward_stores_each_token_at_its_slot_and_position_only():
    cache = SlotKVCache(num_slots=3, capacity=4, device="cpu")
    token_slots = torch.tensor([[1, 1, 2, -1]])  # (R, N): two prompts packed, one padding
    positions = torch.tensor([[0, 1, 0, -1]])
    key = torch.arange(1 * 1 * 4 * 2, dtype=torch.float32).view(1, 1, 4, 2) + 1  # (R, Hkv, N, D)
    cache.bind_packed(token_slots, positions)
    assert cache.bound() == (token_slots, positions)
    cache.store(0, key, -key)
    with pytest.raises(RuntimeError, match="call store"):
        cache.update(0, key, key)
    cache.unbind()
    keys, values = cache._keys[0], cache._values[0]
    assert torch.equal(keys[1, :, :2], key[0, :, :2]) and torch.equal(keys[2, :, 0], key[0, :, 2])
    assert torch.equal(values[1, :, :2], -key[0, :, :2])
    written = torch.zeros(3, 4, dtype=torch.bool)
    written[1, :2] = written[2, 0] = True
    assert torch.equal(keys[:, 0].ne(0).all(-1), written)  # the padding token wrote nothing


def test_update_slots_returns_the_whole_buffers_in_the_storage_dtype_and_each_rows_slot():
    cache = SlotKVCache(num_slots=2, capacity=5, device="cpu", dtype=torch.float32, block=4)
    assert cache.capacity == 8  # rounded up to a multiple of the block
    key = torch.ones(1, 2, 1, 3, dtype=torch.bfloat16)
    slots, q_pos = torch.tensor([1]), torch.tensor([[3]])
    cache.bind(slots, q_pos)
    assert cache.bound() == (slots, q_pos)
    keys, values, got_pos, got_slots = cache.update_slots(0, key, 2 * key)
    assert keys.shape == (2, 2, 8, 3) and keys.dtype == torch.float32
    assert got_slots is slots and got_pos is q_pos
    assert torch.equal(keys[1, :, 3], torch.ones(2, 3)) and torch.equal(
        values[1, :, 3], 2 * torch.ones(2, 3)
    )
    assert int(keys.ne(0).sum()) == 6  # that token's row only


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_slots": 0}, "num_slots must be >= 1, got 0"),
        ({"capacity": 0}, "capacity must be >= 1, got 0"),
        ({"block": 0}, "block must be >= 1, got 0"),
    ],
)
def test_bad_sizes_are_refused_naming_the_argument(kwargs, match):
    sizes = {"num_slots": 2, "capacity": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        SlotKVCache(sizes.pop("num_slots"), sizes.pop("capacity"), "cpu", **sizes)


def test_bad_bindings_and_reads_outside_a_forward_are_refused():
    cache = SlotKVCache(num_slots=2, capacity=4, device="cpu")
    with pytest.raises(ValueError, match=r"slots must be \(B,\) and q_positions \(B, Tq\)"):
        cache.bind(torch.tensor([0, 1]), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="token_slots and positions must be"):
        cache.bind_packed(torch.tensor([[0, 0]]), torch.tensor([[0]]))
    with pytest.raises(ValueError, match="positions reach 4, but the cache holds 4"):
        cache.bind_packed(torch.tensor([[0]]), torch.tensor([[4]]))
    with pytest.raises(RuntimeError, match="outside a bound forward"):
        cache.bound()
    cache.bind(torch.tensor([0]), torch.tensor([[0]]))
    cache.update(0, torch.ones(1, 1, 1, 2), torch.ones(1, 1, 1, 2))
    with pytest.raises(RuntimeError, match="inside a bound forward"):
        cache.copy_rows(0, [1], 1)
