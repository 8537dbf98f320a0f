"""`token_logprobs(model, input_ids, ...)`: per-token logprobs of a causal LM, teacher-forced.

Runs the decoder to its last hidden states and scores them with the fused,
chunked `linear_logp` op the model computes with (`model_op`: the patched
model's backend, or its device's default): logits for all tokens are never
materialised. Position t scores token t+1 given tokens <= t.

Two layouts, one definition: `score_targets` / `token_logprobs` take a
right- or left-padded batch; `packed_score_targets` / `packed_token_logprobs`
take packed rows (`rl_engine.logprobs.packing.PackedBatch`: sequences concatenated,
positions restarting at 0). With a patched model both give every token the
same bits; an unpatched model runs transformers' own packed attention
(block-diagonal mask from the restarting position ids), whose bits differ.
"""

from __future__ import annotations

import torch

from rl_engine.logprobs.packing import PackedBatch, right_padded
from rl_engine.patching import PACKED_KWARG, PackedSegments, lm_head_parameters, model_op
from rl_engine.patching.gradient_route import gradient_route

IGNORE_INDEX = -100


def positions_from_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Each token's position in its own sequence (left or right padding); 0 on padding."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_(min=0)


def scored_targets(input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """(B, T-1) targets: token t+1, or IGNORE_INDEX where t or t+1 is padding."""
    targets = input_ids[:, 1:].clone()
    if attention_mask is not None:
        live = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
        targets[~live] = IGNORE_INDEX
    return targets


def final_hidden_states(model, input_ids, attention_mask=None, **forward_kwargs) -> torch.Tensor:
    """(B, T, H) output of the decoder's final norm, with per-sequence positions."""
    if attention_mask is not None and "position_ids" not in forward_kwargs:
        forward_kwargs["position_ids"] = positions_from_attention_mask(attention_mask)
    out = model.base_model(
        input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **forward_kwargs
    )
    return out.last_hidden_state


def score_targets(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    targets: torch.Tensor,
    *,
    temperature: float,
    deferred_weight_grad: list | None = None,
) -> torch.Tensor:
    """THE trainer logprob: fp32 (B, T-1) log_softmax(logits / temperature)[targets], 0 at IGNORE_INDEX.

    Hidden state of position t (final norm) -> the LM head through the fused `linear_logp`
    op the model computes with (`model_op`: its patch's backend, or its device's default)
    -> the entry of targets[:, t]. Used by `token_logprobs`,
    the DeepSpeed worker's module and the diagnostics. `deferred_weight_grad`: linear_logp's
    (the worker's tied LM-head gradient, `executors/worker/tied_gradient.py`).
    """
    hidden = final_hidden_states(model, input_ids, attention_mask)  # (B, T, H)
    weight, bias = lm_head_parameters(model)  # (V, H), (V,) | None
    linear_logp = model_op(model, "linear_logp")
    return linear_logp(
        hidden[:, :-1],
        weight,
        targets,
        bias,
        temperature=temperature,
        ignore_index=IGNORE_INDEX,
        **_logp_kwargs(model, deferred_weight_grad),
    )


def token_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    temperature: float = 1.0,
) -> torch.Tensor:
    """fp32 (B, T-1): log p(token t+1 | tokens <= t) under softmax(logits / temperature).

    Entries whose context or target token is padding are 0.
    """
    _check_inputs(input_ids, attention_mask)
    targets = scored_targets(input_ids, attention_mask)  # (B, T-1)
    return score_targets(model, input_ids, attention_mask, targets, temperature=temperature)


def _check_inputs(input_ids, attention_mask):
    if input_ids.dim() != 2:
        raise ValueError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] < 2:
        raise ValueError(
            f"input_ids needs at least 2 tokens per row to score one, got {input_ids.shape[1]}"
        )
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise ValueError(
            f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape {tuple(input_ids.shape)}"
        )


# ----------------------------------------------------------------------------- packed rows


def packed_final_hidden_states(model, input_ids, positions, segments) -> torch.Tensor:
    """(R, N, H) output of the decoder's final norm on packed rows (see `packed_score_targets`)."""
    out = model.base_model(
        input_ids=input_ids,
        position_ids=positions.clamp(min=0),
        use_cache=False,
        **{PACKED_KWARG: PackedSegments(positions, segments)},
    )
    return out.last_hidden_state


def packed_score_targets(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    segments: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    deferred_weight_grad: list | None = None,
) -> torch.Tensor:
    """THE trainer logprob on packed rows: fp32 (R, N), 0 at IGNORE_INDEX.

    input_ids, positions (-1 = padding), segments: (R, N), the layout of
    `rl_engine.logprobs.packing.PackedBatch`; targets (R, N): the token each packed position
    scores (`PackedBatch.pack_values` of the padded targets), IGNORE_INDEX elsewhere.
    The decoder runs without an attention mask, with position ids that restart per
    sequence (padding at 0) and with `rl_packed` (the segments the invariant attention
    reads). Used by `packed_token_logprobs`, the DeepSpeed worker's module (packing) and
    the diagnostics. `deferred_weight_grad`: as in `score_targets`.
    """
    if not (input_ids.shape == positions.shape == segments.shape == targets.shape):
        raise ValueError(
            "input_ids, positions, segments and targets must share one (R, N) shape, got "
            f"{[tuple(t.shape) for t in (input_ids, positions, segments, targets)]}"
        )
    hidden = packed_final_hidden_states(model, input_ids, positions, segments)  # (R, N, H)
    weight, bias = lm_head_parameters(model)  # (V, H), (V,) | None
    linear_logp = model_op(model, "linear_logp")
    return linear_logp(
        hidden,
        weight,
        targets,
        bias,
        temperature=temperature,
        ignore_index=IGNORE_INDEX,
        **_logp_kwargs(model, deferred_weight_grad),
    )


def packed_token_logprobs(
    model: torch.nn.Module,
    sequences,
    *,
    temperature: float = 1.0,
    rows=None,
) -> list[torch.Tensor]:
    """fp32 log p(token t+1 | tokens <= t) of each sequence (a (L_i - 1,) tensor each), packed.

    sequences: token-id lists or 1-D tensors, each of at least 2 tokens; rows[i]: the packed
    row of sequence i (default: all in one row). Bitwise equal to `token_logprobs` of the
    same sequences in a padded batch when the model is patched.
    """
    lengths = [len(s) for s in sequences]
    if any(n < 2 for n in lengths):
        raise ValueError(
            f"every sequence needs at least 2 tokens to score one, got lengths {lengths}"
        )
    device = model.get_input_embeddings().weight.device
    ids, mask = (t.to(device) for t in right_padded(sequences))
    packed = PackedBatch.from_padded(ids, mask, rows)
    targets = packed.pack_values(scored_targets(ids, mask), IGNORE_INDEX)
    logp = packed_score_targets(
        model, packed.input_ids, packed.positions, packed.segments, targets, temperature=temperature
    )
    padded = packed.unpack_values(logp)  # (S, T-1)
    return [padded[i, : n - 1] for i, n in enumerate(lengths)]


def _logp_kwargs(model, deferred_weight_grad) -> dict:
    """`spans=` / `sink=` of a layout-invariant training forward (patching/gradient_route.py),
    whose sink takes the head's per-sequence partials: then no deferred tied gradient."""
    route = gradient_route(model)
    if route is not None and route.logp_spans is not None:
        return route.logp_kwargs()
    return {"deferred_weight_grad": deferred_weight_grad}
