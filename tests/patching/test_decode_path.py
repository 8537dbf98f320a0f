"""The engine's fast decode path (patching/decode_path.py) == its module path, bit for bit.

For the four dense families, fp32 and bf16, 1 and 2 threads: the same `generate` (7 ragged
prompts through 3 slots, so requests are admitted mid-run and prefilled padded and packed;
stop tokens, so some stop early) once with the FastDecoder and once with
`fast_decoder` switched off (transformers' modules calling the patched ops): tokens and
logprobs torch.equal. test_parity.py shows the module path == the trainer's teacher-forced
recompute, so the fast path == the trainer too.

Negative control: the same FastDecoder with one plain kernel (torch's own GEMM for every
projection) does not match, so the equality above is not vacuous. Fallbacks: a model the
plan does not know exactly (MoE, forward hooks, unpatched) gets None and one warning, and
the engine then runs the module path.
"""

from __future__ import annotations

import dataclasses
import logging
from unittest import mock

import pytest
import torch

from rl_engine.patching import fast_decoder
from rl_engine.rollout import RolloutEngine, SamplingParams, stepper
from tests.helpers.rollout.common import (
    DENSE_FAMILIES,
    DTYPES,
    fresh_model,
    random_prompts,
    stop_ids,
)

PROMPT_LENGTHS = (5, 11, 1, 17, 3, 8, 26)  # 7 requests, ragged
MAX_NEW = 20
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down")


def _generate(model, temperature=1.0, seed=0):
    """(token ids, logprobs) of every completion of one generate call."""
    vocab = model.config.vocab_size
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    sampling = SamplingParams(
        max_new_tokens=MAX_NEW,
        temperature=temperature,
        seed=seed,
        stop_token_ids=stop_ids(vocab, vocab // 20),
    )
    completions = engine.generate(random_prompts(vocab, PROMPT_LENGTHS, seed=seed), sampling)
    return [(c.token_ids, torch.as_tensor(c.logprobs)) for c in completions]


def _module_path(model):
    with mock.patch.object(stepper, "fast_decoder", return_value=None):
        return _generate(model)


def _assert_same(fast, module) -> None:
    assert len(fast) == len(module)
    for (tokens_a, logp_a), (tokens_b, logp_b) in zip(fast, module):
        assert tokens_a == tokens_b
        assert torch.equal(logp_a, logp_b)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", DENSE_FAMILIES)
def test_fast_decoder_equals_module_path(name, dtype, threads):
    model = fresh_model(name, dtype)
    assert fast_decoder(model) is not None  # the fast path is what runs below
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        fast, module = _generate(model), _module_path(model)
    finally:
        torch.set_num_threads(before)
    _assert_same(fast, module)
    assert min(len(tokens) for tokens, _ in fast) < MAX_NEW  # some requests stopped early


def test_negative_control_plain_gemm_in_the_fast_path_differs():
    """fp32 only: in bf16 the tiny models' short sums round torch's GEMM to the same bits."""
    model = fresh_model("tiny-llama", torch.float32)

    def plain_gemm(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)

    def with_plain_projections(m):
        decoder = fast_decoder(m)
        decoder.layers = [
            dataclasses.replace(
                layer, **{name: (plain_gemm, *getattr(layer, name)[1:]) for name in PROJECTIONS}
            )
            for layer in decoder.layers
        ]
        return decoder

    with mock.patch.object(stepper, "fast_decoder", with_plain_projections):
        plain = _generate(model)
    module = _module_path(model)
    assert any(
        tokens_a != tokens_b or not torch.equal(logp_a, logp_b)
        for (tokens_a, logp_a), (tokens_b, logp_b) in zip(plain, module)
    )


def test_moe_family_keeps_the_module_path(caplog):
    model = fresh_model("tiny-qwen3-moe")
    with caplog.at_level(logging.WARNING, logger="rl_engine.patching.decode_path"):
        assert fast_decoder(model) is None
        assert fast_decoder(model) is None
    # one line per reason, not one per call
    assert sum("module path runs" in r.message for r in caplog.records) <= 1


def test_forward_hooks_keep_the_module_path():
    model = fresh_model("tiny-llama")
    handle = model.base_model.layers[0].mlp.register_forward_hook(lambda *args: None)
    try:
        assert fast_decoder(model) is None
    finally:
        handle.remove()
    assert fast_decoder(model) is not None


def test_unpatched_model_has_no_fast_decoder():
    assert fast_decoder(fresh_model("tiny-llama", patched=False)) is None


def _ragged_and_padded(model, decoder, lengths=(4, 1, 2)):
    """Final hidden states of the real cells of one ragged batch (rows of `lengths` tokens
    after cached prefixes), run ragged (real mask) and padded, each on a fresh cache."""
    from rl_engine.rollout.kv_cache import SlotKVCache

    starts = (0, 6, 3)
    ids = torch.randint(
        3, model.config.vocab_size, (3, 4), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.full((3, 4), -1)
    for row, (n, start) in enumerate(zip(lengths, starts)):
        positions[row, :n] = torch.arange(start, start + n)
    real = positions >= 0
    outs = []
    for mask in (real, None):
        cache = SlotKVCache(3, 16, torch.device("cpu"), dtype=torch.float32, block=16)
        prefix = torch.arange(8).expand(3, 8)  # every slot's first positions, written first
        cache.bind(torch.arange(3), prefix)
        decoder(ids[:, :1].expand(3, 8).contiguous(), prefix, cache)
        cache.unbind()
        cache.bind(torch.arange(3), positions)
        with torch.no_grad():
            outs.append(decoder(ids, positions.clamp(min=0), cache, mask)[real])
        cache.unbind()
    return outs


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen3"])
def test_a_ragged_batch_computes_the_padded_batchs_bits(name, dtype):
    model = fresh_model(name, dtype)
    ragged, padded = _ragged_and_padded(model, fast_decoder(model))
    assert torch.equal(ragged, padded)


def test_negative_control_a_ragged_batch_with_plain_gemm_differs():
    """torch's own GEMM picks its kernel by the row count: one real token (a GEMV) against
    the 12 rows of its padded batch differ, at any thread count."""
    model = fresh_model("tiny-llama", torch.float32)
    decoder = fast_decoder(model)

    def plain_gemm(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)

    decoder.layers = [
        dataclasses.replace(
            layer, **{name: (plain_gemm, *getattr(layer, name)[1:]) for name in PROJECTIONS}
        )
        for layer in decoder.layers
    ]
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            ragged, padded = _ragged_and_padded(model, decoder, lengths=(1, 0, 0))
            assert not torch.equal(ragged, padded), f"{threads} threads"
    finally:
        torch.set_num_threads(before)
