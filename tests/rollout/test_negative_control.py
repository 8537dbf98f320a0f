"""Negative control: without invariance, rollout logprobs do NOT equal a teacher-forced recompute.

Shows that the parity tests measure something: an unpatched model, sampled by HF
`generate` (logits recorded with output_logits) or by this engine in its
invariance-off mode, disagrees with a padded teacher-forced forward of the same
sequences on some tokens. The exact-match fraction is printed (run with -s).
"""

from __future__ import annotations

import pytest
import torch

from rl_engine.rollout import RolloutEngine, SamplingParams
from tests.helpers.rollout.common import fresh_model, pad_batch, random_prompts

PROMPT_LENGTHS = (5, 11, 3, 8, 14, 6)
NEW = 16


def _teacher_forced(model, prompts, completions, temperature=1.0):
    """Plain HF forward (no invariance) over all sequences in one left-padded batch."""
    seqs = [p + c for p, c in zip(prompts, completions)]
    ids, mask, offsets = pad_batch(seqs, "left")
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.float()
    logp = torch.log_softmax(logits / temperature, -1)
    out = []
    for row, (p, c) in enumerate(zip(prompts, completions)):
        cols = torch.arange(offsets[row] + len(p) - 1, offsets[row] + len(p) + len(c) - 1)
        out.append(logp[row, cols, torch.tensor(c)])
    return out


def _exact_fraction(a, b) -> float:
    x, y = torch.cat(a), torch.cat(b)
    return (x == y).float().mean().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_hf_generate_logprobs_differ_from_recompute(dtype):
    model = fresh_model("tiny-llama", dtype, patched=False)
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=1)
    ids, mask, _ = pad_batch(prompts, "left")
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[:, ids.shape[1] :]  # (B, NEW)
    logp = torch.log_softmax(torch.stack(out.logits, 1).float(), -1)  # (B, NEW, V)
    rollout = [logp[b].gather(-1, tokens[b, :, None])[:, 0] for b in range(len(prompts))]
    recomputed = _teacher_forced(model, prompts, tokens.tolist())
    fraction = _exact_fraction(rollout, recomputed)
    print(f"\nHF generate ({dtype}) vs teacher-forced: {fraction:.1%} of tokens exactly equal")
    assert fraction < 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_engine_with_invariance_off_differs_from_recompute(dtype):
    model = fresh_model("tiny-llama", dtype, patched=False)
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=1)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, seed=3))
    assert not engine.batch_invariant
    recomputed = _teacher_forced(model, prompts, [c.token_ids for c in completions])
    fraction = _exact_fraction([c.logprobs for c in completions], recomputed)
    print(
        f"\nengine, invariance off ({dtype}) vs teacher-forced: {fraction:.1%} of tokens exactly equal"
    )
    assert fraction < 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_engine_with_invariance_off_differs_from_recompute(dtype):
    """An unpatched Mixtral (HF's default grouped_mm experts, torch.topk routing) in the engine."""
    model = fresh_model("tiny-mixtral", dtype, patched=False)
    prompts = random_prompts(model.config.vocab_size, PROMPT_LENGTHS, seed=1)
    engine = RolloutEngine(model, device="cpu", max_batch_size=3, progress=False)
    completions = engine.generate(prompts, SamplingParams(max_new_tokens=NEW, seed=3))
    recomputed = _teacher_forced(model, prompts, [c.token_ids for c in completions])
    fraction = _exact_fraction([c.logprobs for c in completions], recomputed)
    print(f"\nMoE engine, invariance off ({dtype}) vs teacher-forced: {fraction:.1%} exactly equal")
    assert model.config._experts_implementation == "grouped_mm"
    assert fraction < 1.0
