"""Hand-made rollout completions for the batch tests."""

from __future__ import annotations

import torch

from rl_engine.rollout import Completion


def completion(prompt, tokens, logprobs=None, index=0, temperature=1.0, version=0):
    logprobs = (
        torch.linspace(-1.0, -2.0, len(tokens)) if logprobs is None else torch.as_tensor(logprobs)
    )
    return Completion(
        prompt_ids=list(prompt),
        token_ids=list(tokens),
        logprobs=logprobs.float(),
        finish_reason="length",
        weight_version=version,
        prompt_index=index,
        sample_index=0,
        logprob_temperature=temperature,
    )


def two_groups():
    comps = [
        completion([5, 6, 7], [10, 11]),
        completion([5, 6, 7], [12, 13, 14, 15]),
        completion([8], [20], index=1),
        completion([8], [21, 22, 23], index=1),
    ]
    return comps, [1.0, 0.0, 0.5, 2.0]
