"""What `generate` returns (`Completion`) and a request while it is generated (`Request`).

A request is one (prompt index, sample index) pair with its own key (sampling.py: the token at
index i of the request is drawn with `token_uniform(key, i)`). It collects each sampled token
and its logprob and finishes on the first stop / EOS token (kept as its last token) or at
`max_new_tokens` (its own, or the sampling's); the finished request becomes a `Completion`. A
model turn of an episode is one request; the next turn is a new request in the same slot
(turns.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl_engine.rollout.sampling import SamplingParams


@dataclass
class Completion:
    """One sampled completion; `logprobs[i]` is the fp32 logprob of `token_ids[i]`.

    A logprob is log_softmax(logits / logprob_temperature) over the full vocabulary (never
    renormalised by top-k / top-p); `weight_version` is the engine's weights' version.
    """

    prompt_ids: list[int]
    token_ids: list[int]
    logprobs: torch.Tensor  # (len(token_ids),) fp32
    finish_reason: str  # "stop" (EOS / stop token, included in token_ids) | "length"
    weight_version: int | None  # None: read from a rollout file that did not say
    prompt_index: int
    sample_index: int
    logprob_temperature: float = 1.0
    reward: float | None = None  # set by the job before saving, or read from a rollout file


@dataclass
class Request:
    """A request while it is generated; `slot` is its KV-cache slot while it runs (-1: none)."""

    prompt_index: int
    sample_index: int
    prompt_ids: list[int]
    key: int
    """The key of its draws (`request_key` / `turn_key`): token i uses `token_uniform(key, i)`."""
    slot: int = -1
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    shares_prefill: bool = True
    """Whether its prefill may be shared with requests of the same prompt (prompt_sharing.py).
    False for a prefill that continues a transcript after an environment turn (multi-turn:
    `generate(..., after_env_turn=True)`): a group's transcripts diverge, and such a prefill
    always runs on its own."""
    max_new_tokens: int | None = None
    """This request's own budget of sampled tokens (None: the sampling's `max_new_tokens`);
    a model turn of an episode gets what is left of `max_total_tokens` (turns.py)."""
    cached: int = 0
    """How many leading `prompt_ids` its slot already holds when admitted: a turn that
    continues an episode in its own slot prefills only the ids after them (turns.py)."""

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.token_ids)

    @property
    def share_key(self) -> tuple[int, ...] | None:
        """What its prefill is shared by: the full token list it prefills at admission (None:
        it never shares)."""
        return tuple(self.prompt_ids) if self.shares_prefill else None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def append(self, token: int, logprob: float, sampling: SamplingParams) -> None:
        self.token_ids.append(token)
        self.logprobs.append(logprob)
        if sampling.stops_on(token):
            self.finish_reason = "stop"
        elif len(self.token_ids) >= (self.max_new_tokens or sampling.max_new_tokens):
            self.finish_reason = "length"

    def completion(self, weight_version: int, logprob_temperature: float) -> Completion:
        return Completion(
            prompt_ids=list(self.prompt_ids),
            token_ids=list(self.token_ids),
            logprobs=torch.tensor(
                self.logprobs, dtype=torch.float32
            ),  # fp32 -> float -> fp32 is exact
            finish_reason=self.finish_reason,
            weight_version=weight_version,
            prompt_index=self.prompt_index,
            sample_index=self.sample_index,
            logprob_temperature=logprob_temperature,
        )
