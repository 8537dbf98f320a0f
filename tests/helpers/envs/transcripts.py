"""The engine-parity check of an episode: the trainer's recompute of the whole transcript."""

from __future__ import annotations

import torch

from rl_engine.logprobs import token_logprobs

PROMPT_LENGTHS = (5, 11, 3, 8)


def policy_logprobs(model, episode) -> tuple[torch.Tensor, torch.Tensor]:
    """(the trainer's recompute of the whole transcript, the engine's) at the policy's tokens."""
    ids = torch.tensor([episode.prompt_ids + episode.token_ids])
    with torch.no_grad():
        trainer = token_logprobs(model, ids)[0, len(episode.prompt_ids) - 1 :]  # (len(tokens),)
    mask = torch.tensor(episode.policy_mask)
    return trainer[mask], episode.logprobs[mask]
