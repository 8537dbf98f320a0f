"""The engine's side of speculation: check its arguments once, attach it to each call's stepper."""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.patching import is_patched
from rl_engine.rollout.speculative.params import SpeculativeParams
from rl_engine.rollout.speculative.proposers import DraftEngine, DraftProposer, NgramProposer
from rl_engine.rollout.speculative.verify import SpeculativeDecode


class SpeculationError(ValueError):
    """Speculation was asked for where it cannot keep the bits of plain decoding."""


def check_speculation(
    params: SpeculativeParams | None, model: nn.Module, draft_model: nn.Module | None, device
) -> None:
    """Refuse, by name, a speculation that could change a token or a logprob."""
    if params is None:
        if draft_model is not None:
            raise SpeculationError("draft_model given without speculative=SpeculativeParams(...)")
        return
    if not isinstance(params, SpeculativeParams):
        raise SpeculationError(f"speculative must be a SpeculativeParams, got {params!r}")
    if not is_patched(model):
        raise SpeculationError(
            "speculative decoding needs a patched (batch-invariant) policy: only then does a "
            "verifying forward give the bits of decoding one token at a time"
        )
    if params.method == "ngram":
        if draft_model is not None:
            raise SpeculationError("draft_model given with speculative method 'ngram'")
        return
    if draft_model is None:
        raise SpeculationError("speculative method 'draft_model' needs draft_model=<a causal LM>")
    _check_draft(model, draft_model, torch.device(device))


def _check_draft(model: nn.Module, draft: nn.Module, device: torch.device) -> None:
    vocab = model.get_input_embeddings().weight.shape[0]
    draft_vocab = draft.get_input_embeddings().weight.shape[0]
    if draft_vocab != vocab:
        raise SpeculationError(
            f"draft_model's vocabulary has {draft_vocab} rows, the policy's {vocab}: the draft "
            "must use the policy's tokenizer"
        )
    if not is_patched(draft):
        raise SpeculationError(
            "draft_model must be patched (apply_batch_invariant) like the policy: it runs "
            "with the same invariant kernels"
        )
    where = next(draft.parameters()).device
    if where.type != device.type:
        raise SpeculationError(f"draft_model is on {where}, the engine on {device}")


def attach_speculation(engine, stepper, make_cache, sampling) -> DraftEngine | None:
    """Give `stepper` its SpeculativeDecode (the engine's `speculative`); returns the draft's
    engine view (its weights packed into the engine's store) or None."""
    params: SpeculativeParams = engine.speculative
    if params.method == "ngram":
        stepper.speculation = SpeculativeDecode(stepper, params, NgramProposer(params))
        return None
    from rl_engine.rollout.stepper import Stepper

    draft = DraftEngine(
        engine.draft_model,
        engine.device,
        batch_invariant=True,
        packed_weights=engine.packed_weights,
    )
    draft_stepper = Stepper(draft, make_cache(engine.draft_model), sampling)
    stepper.speculation = SpeculativeDecode(stepper, params, DraftProposer(draft_stepper, params))
    return draft
