"""The engine's packed GEMM weights (patching/packed_weights.py) are never stale.

The FastDecoder runs its projections and LM head on copies of the weights packed into the
engine's `packed_weights` at the start of every generate call. After the weights change
between calls (`load_weights`, and an in-place write through `.data`, which a tensor's
version counter does not see), the next call's tokens and logprobs are torch.equal to the
module path on the new weights. Negative control: a store that keeps its first packing
(no repack per call) gives other tokens or logprobs after the change. The store holds one
packed copy of each GEMM weight, kept between calls and repacked in place by the next
one (no new buffer); `release_packed_weights` frees them, and the next call packs anew.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from rl_engine.patching.packed_weights import PackedWeights
from rl_engine.rollout import RolloutEngine, SamplingParams, stepper
from tests.helpers.rollout.common import fresh_model, random_prompts

PROMPT_LENGTHS = (5, 11, 1, 17)


def _generate(engine):
    vocab = engine.model.config.vocab_size
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, seed=0)
    completions = engine.generate(random_prompts(vocab, PROMPT_LENGTHS, seed=0), sampling)
    return [(c.token_ids, torch.as_tensor(c.logprobs)) for c in completions]


def _module_path(model):
    with mock.patch.object(stepper, "fast_decoder", return_value=None):
        return _generate(RolloutEngine(model, device="cpu", max_batch_size=3, progress=False))


def _same(a, b) -> bool:
    return all(ta == tb and torch.equal(la, lb) for (ta, la), (tb, lb) in zip(a, b))


def _changed_state(model):
    """Every parameter and buffer, the projections' weights scaled."""
    state = model.state_dict()
    return {name: t * 1.25 if "proj" in name else t for name, t in state.items()}


def test_weights_changed_between_calls_are_repacked():
    model = fresh_model("tiny-llama", torch.bfloat16)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    assert _same(_generate(engine), _module_path(model))
    assert engine.packed_weights._entries != {}  # kept for the next call
    engine.load_weights(_changed_state(model), version=1)
    assert _same(_generate(engine), _module_path(model))
    model.model.layers[0].mlp.down_proj.weight.data.mul_(-1)  # unseen by _version
    assert _same(_generate(engine), _module_path(model))


def test_negative_control_a_store_that_never_repacks_is_stale():
    model = fresh_model("tiny-llama", torch.bfloat16)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    first: dict[int, object] = {}
    real_pack = PackedWeights.pack

    def pack_once(self, weight, packing):
        if id(weight) not in first:
            first[id(weight)] = real_pack(self, weight, packing)
        return first[id(weight)]

    with mock.patch.object(PackedWeights, "pack", pack_once):
        _generate(engine)
        engine.load_weights(_changed_state(model), version=1)
        stale = _generate(engine)
    assert not _same(stale, _module_path(model))


def _buffers(store) -> dict[int, int]:
    """{weight id: data_ptr of its packed buffer} of the store's live entries."""
    return {key: packed.data.data_ptr() for key, (_, packed) in store._entries.items()}


def test_the_store_keeps_one_packed_copy_of_each_gemm_weight_and_repacks_it_in_place():
    model = fresh_model("tiny-llama", torch.float32)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    _generate(engine)
    gemm = [p for n, p in model.named_parameters() if "proj" in n]
    head = model.get_output_embeddings().weight
    weights = gemm + ([] if any(head is p for p in gemm) else [head])
    logical = sum(p.numel() * p.element_size() for p in weights)
    store = engine.packed_weights
    assert sorted(store._entries) == sorted(id(w) for w in weights)
    # the panels pad N to 64 columns and K to whole blocks, nothing more
    assert logical <= store.nbytes < 2 * logical
    first = _buffers(store)
    engine.load_weights(_changed_state(model), version=1)
    assert _same(_generate(engine), _module_path(model))
    assert _buffers(store) == first  # repacked into the same buffers


def test_released_packed_weights_are_packed_anew_by_the_next_call():
    model = fresh_model("tiny-llama", torch.bfloat16)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    _generate(engine)
    held = engine.packed_weights.nbytes
    assert held > 0
    assert engine.release_packed_weights() == held
    assert engine.packed_weights._entries == {} and engine.packed_weights.nbytes == 0
    engine.load_weights(_changed_state(model), version=1)
    assert _same(_generate(engine), _module_path(model))
    assert engine.packed_weights.nbytes == held


def test_a_call_that_raises_leaves_buffers_the_next_call_repacks():
    model = fresh_model("tiny-llama", torch.float32)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    with mock.patch.object(stepper.Stepper, "decode", side_effect=RuntimeError("boom")):
        with pytest.raises(RuntimeError, match="boom"):
            _generate(engine)
    assert engine.packed_weights.nbytes > 0
    engine.load_weights(_changed_state(model), version=1)
    assert _same(_generate(engine), _module_path(model))
