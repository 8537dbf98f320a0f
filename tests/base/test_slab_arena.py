"""Slab arena: adopted tensors keep their values in slots of shared slabs, a slab lives until its
last slot is released, and tensors it cannot hold are returned as they are."""

import torch

from rl_engine.base.slab_arena import SlabArena


def test_slots_keep_their_values_and_share_a_slab():
    arena = SlabArena(slab_bytes=1 << 16)
    a, b = torch.randn(7, 5), torch.arange(11, dtype=torch.bfloat16)
    slot_a, slot_b = arena.adopt(a.clone()), arena.adopt(b.clone())
    assert torch.equal(slot_a, a) and torch.equal(slot_b, b)
    assert slot_a.shape == a.shape and slot_b.dtype == torch.bfloat16
    c = arena.adopt(torch.ones(3))
    assert c.untyped_storage().data_ptr() == slot_a.untyped_storage().data_ptr()
    assert c.data_ptr() % 64 == 0, "a slot starts on a cache line"
    assert arena.slabs == 2  # one chain per dtype


def test_a_slab_is_dropped_with_its_last_slot():
    arena = SlabArena(slab_bytes=1 << 12)
    slots = [arena.adopt(torch.full((64,), float(i))) for i in range(8)]  # 256 B each
    assert arena.slabs == 1
    for slot in slots[:-1]:
        arena.release(slot)
    assert arena.slabs == 1
    arena.release(slots[-1])
    assert arena.slabs == 0
    fresh = arena.adopt(torch.zeros(4))
    assert arena.slabs == 1 and torch.equal(fresh, torch.zeros(4))


def test_large_empty_or_foreign_tensors_are_returned_as_they_are():
    arena = SlabArena(slab_bytes=1 << 12)
    big = torch.zeros(1 << 10)  # 4 KiB: more than a quarter slab
    empty = torch.zeros(0)
    assert arena.adopt(big) is big and arena.adopt(empty) is empty
    arena.release(big)  # a no-op
    assert arena.slabs == 0
