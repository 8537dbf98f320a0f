"""The engine's packed GEMM weights (patching/packed_weights.py) are never stale.

The FastDecoder runs its projections and LM head on copies of the weights packed into the
engine's `packed_weights` at the start of every generate call. After the weights change
between calls (`load_weights`, and an in-place write through `.data`, which a tensor's
version counter does not see), the next call's tokens and logprobs are torch.equal to the
module path on the new weights. Negative control: a store that keeps its first packing
(no repack per call) gives other tokens or logprobs after the change. During a call the
store holds one packed copy of each GEMM weight; between calls it holds none (the engine
releases them when the call returns, even when the call raises).
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
    assert engine.packed_weights._entries == {}
    engine.load_weights(_changed_state(model), version=1)
    assert _same(_generate(engine), _module_path(model))
    model.model.layers[0].mlp.down_proj.weight.data.mul_(-1)  # unseen by _version
    assert _same(_generate(engine), _module_path(model))
    assert engine.packed_weights._entries == {}


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


def _held_at_release(engine) -> list[tuple[int, int]]:
    """(entries, nbytes) of the engine's store each time it is released (a call's end)."""
    held = []
    store = engine.packed_weights
    real_release = store.release

    def release():
        held.append((len(store._entries), store.nbytes))
        real_release()

    store.release = release
    return held


def test_the_store_holds_one_packed_copy_of_each_gemm_weight_during_a_call_only():
    model = fresh_model("tiny-llama", torch.float32)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    held = _held_at_release(engine)
    _generate(engine)
    gemm = [p for n, p in model.named_parameters() if "proj" in n]
    head = model.get_output_embeddings().weight
    weights = gemm + ([] if any(head is p for p in gemm) else [head])
    logical = sum(p.numel() * p.element_size() for p in weights)
    [(entries, nbytes)] = held
    assert entries == len(weights)
    # the panels pad N to 64 columns and K to whole blocks, nothing more
    assert logical <= nbytes < 2 * logical
    assert engine.packed_weights._entries == {} and engine.packed_weights.nbytes == 0


def test_a_call_that_raises_releases_the_store():
    model = fresh_model("tiny-llama", torch.float32)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    held = _held_at_release(engine)
    with mock.patch.object(stepper.Stepper, "decode", side_effect=RuntimeError("boom")):
        with pytest.raises(RuntimeError, match="boom"):
            _generate(engine)
    assert len(held) == 1 and held[0][0] > 0  # it held the packed weights when it raised
    assert engine.packed_weights._entries == {}
