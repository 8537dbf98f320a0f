"""Shared helpers of the rollout tests: models, prompts, and teacher-forced recomputes in many layouts.

Parity is always `torch.equal`: a recorded logprob either equals the recompute
bit for bit or the test fails.
"""

from __future__ import annotations

import functools

import torch

from rl_engine.logprobs import token_logprobs
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams

DENSE_FAMILIES = ("tiny-llama", "tiny-qwen2", "tiny-qwen3", "tiny-mistral")
MOE_FAMILIES = ("tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-olmoe")
FAMILIES = DENSE_FAMILIES + MOE_FAMILIES
DTYPES = (torch.float32, torch.bfloat16)


@functools.cache
def patched_model(name: str, dtype: torch.dtype = torch.float32, seed: int = 0):
    """A patched tiny model, built once per (name, dtype, seed) for the whole session."""
    model, _ = load_model(name, dtype=dtype, seed=seed)
    apply_batch_invariant(model)
    return model


def fresh_model(
    name: str, dtype: torch.dtype = torch.float32, seed: int = 0, *, patched: bool = True
):
    """A new model object (for tests that change weights or attention settings)."""
    model, _ = load_model(name, dtype=dtype, seed=seed)
    if patched:
        apply_batch_invariant(model)
    return model


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    """Prompts of the given lengths with ids in [3, vocab) (0-2 are pad/bos/eos in tiny configs)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def stop_ids(vocab: int, count: int, seed: int = 123) -> tuple[int, ...]:
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randperm(vocab - 3, generator=g)[:count].add(3).tolist())


def full_ids(completion) -> list[int]:
    return list(completion.prompt_ids) + list(completion.token_ids)


def pad_batch(seqs: list[list[int]], side: str, pad_id: int = 0):
    """(input_ids (B, W), attention_mask (B, W), offsets (B,)) with left or right padding."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    offsets = []
    for row, seq in enumerate(seqs):
        start = width - len(seq) if side == "left" else 0
        ids[row, start : start + len(seq)] = torch.tensor(seq)
        mask[row, start : start + len(seq)] = 1
        offsets.append(start)
    return ids, mask, offsets


def completion_slice(
    logprobs_row: torch.Tensor, offset: int, prompt_len: int, total_len: int
) -> torch.Tensor:
    """Logprobs of the completion tokens from one row of token_logprobs' (B, T-1) output."""
    return logprobs_row[offset + prompt_len - 1 : offset + total_len - 1]


def recompute_alone(model, completion, temperature: float) -> torch.Tensor:
    ids = torch.tensor([full_ids(completion)])
    with torch.no_grad():
        lp = token_logprobs(model, ids, temperature=temperature)[0]
    return completion_slice(lp, 0, len(completion.prompt_ids), ids.shape[1])


def recompute_padded(
    model, completions, temperature: float, side: str, fillers=()
) -> list[torch.Tensor]:
    """Recompute every completion in ONE padded batch (plus filler sequences), with attention_mask."""
    seqs = [full_ids(c) for c in completions] + [list(f) for f in fillers]
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(len(seqs))).tolist()
    shuffled = [seqs[i] for i in order]
    ids, mask, offsets = pad_batch(shuffled, side)
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature=temperature)
    out = [None] * len(seqs)
    for row, i in enumerate(order):
        out[i] = lp[row]
        if i < len(completions):
            c = completions[i]
            out[i] = completion_slice(lp[row], offsets[row], len(c.prompt_ids), len(seqs[i]))
    return out[: len(completions)]


def recompute_in_batches_of(
    model, completion, temperature: float, size: int, vocab: int, seed: int
) -> torch.Tensor:
    """Recompute one completion at a random row of a left-padded batch of `size` random sequences."""
    g = torch.Generator().manual_seed(seed)
    target = full_ids(completion)
    lengths = torch.randint(2, len(target) + 8, (size - 1,), generator=g).tolist()
    others = random_prompts(vocab, lengths, seed=seed)
    row = int(torch.randint(0, size, (1,), generator=g))
    seqs = others[:row] + [target] + others[row:]
    ids, mask, offsets = pad_batch(seqs, "left")
    with torch.no_grad():
        lp = token_logprobs(model, ids, mask, temperature=temperature)
    return completion_slice(lp[row], offsets[row], len(completion.prompt_ids), len(target))


def assert_parity(completions, recomputed, label: str) -> None:
    for c, ref in zip(completions, recomputed, strict=True):
        if not torch.equal(c.logprobs, ref):
            diff = (c.logprobs - ref).abs()
            raise AssertionError(
                f"{label}: prompt {c.prompt_index} sample {c.sample_index}: "
                f"{int((diff != 0).sum())}/{diff.numel()} tokens differ, max |diff| {diff.max().item():.3g}"
            )


def assert_same_completions(a, b, label: str) -> None:
    assert len(a) == len(b), f"{label}: {len(a)} vs {len(b)} completions"
    for x, y in zip(a, b):
        assert (x.prompt_index, x.sample_index) == (y.prompt_index, y.sample_index), label
        assert x.token_ids == y.token_ids, (
            f"{label}: prompt {x.prompt_index} sample {x.sample_index} tokens differ"
        )
        assert torch.equal(x.logprobs, y.logprobs), (
            f"{label}: prompt {x.prompt_index} logprobs differ"
        )
        assert x.finish_reason == y.finish_reason, label


def recompute_packed(
    model, completions, temperature: float, rows: int = 1, fillers=()
) -> list[torch.Tensor]:
    """Recompute every completion packed (`packed_token_logprobs`): shuffled together with
    filler sequences, dealt round-robin into `rows` packed rows."""
    from rl_engine.logprobs import packed_token_logprobs

    seqs = [full_ids(c) for c in completions] + [list(f) for f in fillers]
    order = torch.randperm(len(seqs), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        lp = packed_token_logprobs(
            model,
            [seqs[i] for i in order],
            temperature=temperature,
            rows=[j % rows for j in range(len(seqs))],
        )
    out = [None] * len(seqs)
    for j, i in enumerate(order):
        out[i] = lp[j]
    return [
        completion_slice(out[i], 0, len(c.prompt_ids), len(seqs[i]))
        for i, c in enumerate(completions)
    ]


SHARING_PROMPT_LENGTHS = (5, 23, 1, 12, 40)
SHARING_SLOTS = 6  # 28 requests of the sharing scenario through 6 slots


def sharing_scenario_prompts(vocab: int) -> list[list[int]]:
    """7 prompts of mixed lengths; prompts 3 and 6 repeat prompts 1 and 0 (identical prompts
    across groups)."""
    prompts = random_prompts(vocab, SHARING_PROMPT_LENGTHS, seed=3)
    return prompts[:3] + [prompts[1]] + prompts[3:] + [prompts[0]]


def sharing_scenario_sampling(vocab: int) -> SamplingParams:
    stops = stop_ids(vocab, vocab // 15)
    return SamplingParams(
        n=4,
        max_new_tokens=12,
        temperature=0.8,
        seed=2,
        eos_token_id=stops[0],
        stop_token_ids=stops[1:],
    )


def generate_sharing_scenario(model, share: bool):
    """(completions, GenerateStats) of the prompt-sharing scenario (test_prompt_sharing.py)."""
    vocab = model.config.vocab_size
    engine = RolloutEngine(
        model,
        device="cpu",
        max_batch_size=SHARING_SLOTS,
        progress=False,
        share_prompt_prefill=share,
    )
    completions = engine.generate(sharing_scenario_prompts(vocab), sharing_scenario_sampling(vocab))
    return completions, engine.last_stats
