"""Bitwise parity, packed: the engine's logprobs == the packed teacher-forced recompute.

Chain (torch.equal): engine decode == recompute alone (tests/rollout/test_parity.py)
== the same completions packed (`packed_token_logprobs`) into one row, into
three rows, shuffled among filler sequences, and == a forward in transformers'
own packed format (no mask, position ids restarting at 0, no `rl_packed`
kwarg). 4 model families x fp32/bf16. Negative control: an unpatched model
(plain torch attention, transformers' block-diagonal mask for packed rows)
packed does not give its own padded layout's bits.
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.logprobs import IGNORE_INDEX, packed_token_logprobs, token_logprobs
from rl_engine.logprobs.packing import PackedBatch, right_padded
from rl_engine.patching import lm_head_parameters, model_op
from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.rollout.common import (
    DTYPES,
    FAMILIES,
    assert_parity,
    completion_slice,
    fresh_model,
    full_ids,
    patched_model,
    random_prompts,
    recompute_packed,
    stop_ids,
)

PROMPT_LENGTHS = (5, 11, 1, 17, 3, 8, 26)


def _generate(model, seed=0):
    vocab = model.config.vocab_size
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    sampling = SamplingParams(
        max_new_tokens=20, temperature=0.8, seed=seed, stop_token_ids=stop_ids(vocab, vocab // 20)
    )
    return engine.generate(random_prompts(vocab, PROMPT_LENGTHS, seed=seed), sampling)


def _hf_packed_format(model, completions, temperature: float) -> list[torch.Tensor]:
    """One packed row through transformers' own packed format: no attention mask, no
    rl_packed kwarg, position_ids that restart at 0 (the hook finds the sequences)."""
    seqs = [full_ids(c) for c in completions]
    ids, mask = right_padded(seqs)
    packed = PackedBatch.from_padded(ids, mask)
    with torch.no_grad():
        hidden = model.base_model(
            input_ids=packed.input_ids, position_ids=packed.positions, use_cache=False
        ).last_hidden_state
        weight, bias = lm_head_parameters(model)
        targets = packed.pack_values(
            torch.where(mask[:, 1:].bool() & mask[:, :-1].bool(), ids[:, 1:], IGNORE_INDEX),
            IGNORE_INDEX,
        )
        lp = model_op(model, "linear_logp")(
            hidden, weight, targets, bias, temperature=temperature, ignore_index=IGNORE_INDEX
        )
    rows = packed.unpack_values(lp)
    return [
        completion_slice(rows[i], 0, len(c.prompt_ids), len(seqs[i]))
        for i, c in enumerate(completions)
    ]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", FAMILIES)
def test_engine_logprobs_equal_packed_recompute(name, dtype):
    model = patched_model(name, dtype)
    completions = _generate(model)
    assert len({len(c.token_ids) for c in completions}) > 1
    fillers = random_prompts(model.config.vocab_size, (40, 2, 129), seed=9)
    assert_parity(completions, recompute_packed(model, completions, 0.8), "one packed row")
    assert_parity(
        completions, recompute_packed(model, completions, 0.8, 3, fillers), "three packed rows"
    )
    assert_parity(completions, _hf_packed_format(model, completions, 0.8), "HF packed format")


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_negative_control_plain_attention_packed_differs_from_padded(dtype):
    """Unpatched: transformers' packed attention isolates the sequences (close values) but
    its bits differ from its own padded layout somewhere."""
    model = fresh_model("tiny-llama", dtype, patched=False)
    seqs = random_prompts(model.config.vocab_size, (300, 130, 300, 7), seed=4)
    ids, mask = right_padded(seqs)
    with torch.no_grad():
        padded = token_logprobs(model, ids, mask)
        packed = packed_token_logprobs(model, seqs)
    rows = [padded[i, : len(s) - 1] for i, s in enumerate(seqs)]
    assert not all(torch.equal(a, b) for a, b in zip(rows, packed)), (
        "plain packed attention became bitwise equal to padded: re-check the negative control"
    )
    worst = max((a.double() - b.double()).abs().max().item() for a, b in zip(rows, packed))
    assert worst < (1e-3 if dtype == torch.float32 else 0.5)  # no sequence sees another one


@pytest.mark.parametrize(
    ("name", "dtype"), [("tiny-llama", torch.float32), ("tiny-qwen3", torch.bfloat16)]
)
def test_packed_prefill_gives_the_padded_prefills_completions(name, dtype, monkeypatch):
    """The engine's prefill packed (every multi-prompt prefill) vs right-padded (never
    packed): the same tokens and the same logprobs, bit for bit."""
    import rl_engine.rollout.stepper as stepper_module

    model = patched_model(name, dtype)
    runs = {}
    for label, threshold in (("packed", 0.0), ("padded", float("inf"))):
        monkeypatch.setattr(stepper_module, "PACK_PREFILL", threshold)
        engine = RolloutEngine(model, device="cpu", max_batch_size=4, progress=False)
        prompts = random_prompts(model.config.vocab_size, (5, 30, 1, 17, 9, 64, 2), seed=3)
        runs[label] = engine.generate(prompts, SamplingParams(max_new_tokens=8, seed=1))
        runs[label + " stats"] = engine.last_stats
    assert runs["packed stats"].packed_prefills >= 2 and runs["padded stats"].packed_prefills == 0
    assert runs["packed stats"].prefill_forwards == runs["padded stats"].prefill_forwards
    for a, b in zip(runs["packed"], runs["padded"], strict=True):
        assert a.token_ids == b.token_ids and torch.equal(a.logprobs, b.logprobs)
