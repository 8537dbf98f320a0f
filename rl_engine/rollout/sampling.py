"""Sampling parameters and the per-row token draw of the rollout engine.

What a recorded logprob means
-----------------------------
`Completion.logprobs[i]` is log softmax(logits / T)[token_i] over the FULL
vocabulary (T = the sampling temperature; T = 1 for greedy decoding). `top_k`
and `top_p` only restrict which tokens may be *drawn*; they never renormalise
the recorded logprob. That is the quantity the trainer recomputes with
`linear_logp(..., temperature=T)`, so the two can be compared bit for bit.

Reproducibility
---------------
A token's draw is position-keyed, not call-ordered. Every request has a 63-bit key:
`request_key(seed, p, s)` for sample s of prompt p, `turn_key(seed, episode, turn)` for a
model turn of a multi-turn episode. The uniform of the token at index i of that
completion (or turn), counted from 0, is `token_uniform(key, i)`: a hash of (key, i),
with no generator and no state. A token is then drawn from its request's row alone, with
ops on a 1-D tensor (`sample_token`). So no draw depends on call order, on the other rows
of the batch or the batch size, on the engine or process that draws it, or on a draw that
was made and thrown away: the same position decoded alone, verified inside a speculative
block, re-decoded after a resume or drawn by another engine (a vLLM sampler calling these
functions) gives the same token from the same logprob row. Same prompt, same index, same
seed -> same completion.

This replaced a per-request `torch.Generator` read in call order; the tokens of a given
seed changed once with it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, fields

import torch

from rl_engine.base.fields import check_int, check_number, is_int


@dataclass(frozen=True, kw_only=True)
class SamplingKeys:
    """The sampling keys a run's `rollout:` config section shares with SamplingParams.

    The one place that names them, gives their defaults and checks them: SamplingParams and
    rl_engine.config's RolloutConfig both inherit these fields, so `rollout.<key>` in YAML,
    `SamplingParams(<key>=...)` and `SamplingParams.from_config` follow from this class. A new
    sampling key is a field (with its one-line docstring) here and one line of
    `check_sampling_keys`; the engine then reads it from the SamplingParams it is given.
    Keyword-only, so that a new key never shifts the position of another.
    """

    # also the run config's default: token budgets (trainer.max_tokens_per_micro_batch) are sized to it
    max_new_tokens: int = 16
    """Most tokens sampled per completion."""
    temperature: float = 1.0
    """Sampling temperature (0 = greedy). Logprobs are log_softmax(logits / T) with T this
    temperature (1.0 for greedy); the trainer scores each batch at its own T."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off); never renormalises the recorded logprobs."""
    top_k: int = 0
    """Sample among the k most likely tokens (0 = off); never renormalises the logprobs."""

    def __post_init__(self) -> None:
        self.check_sampling_keys()

    def check_sampling_keys(self, section: str = "") -> None:
        """Raise a ValueError naming the first invalid key, prefixed by `section` ('rollout.')."""
        check_int(f"{section}max_new_tokens", self.max_new_tokens, 1)
        check_number(f"{section}temperature", self.temperature, low=0.0)
        check_number(f"{section}top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        check_int(f"{section}top_k", self.top_k, 0)


@dataclass(frozen=True, kw_only=True)
class SamplingParams(SamplingKeys):
    """How to sample completions; one instance applies to every prompt of a `generate` call.

    The sampling keys (max_new_tokens, temperature, top_p, top_k) and their defaults are
    SamplingKeys's, the same as a run config's `rollout:` section.
    temperature 0 means greedy decoding (argmax of the T = 1 logprobs; top_k / top_p and
    the uniforms are unused); its logprobs are recorded at T = 1.
    eos_token_id None means: do not stop on an EOS token (only on `stop_token_ids`).
    """

    n: int = 1
    """Completions per prompt (vLLM's name; the config's `rollout.samples_per_prompt`)."""
    seed: int = 0
    """Seed of the keys that draw the samples (`request_key`, `turn_key`)."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a completion (kept as its last token)."""
    eos_token_id: int | None = None
    """The EOS id that ends a completion; None: stop only on `stop_token_ids`."""

    def __post_init__(self) -> None:
        self.check_sampling_keys()
        if not is_int(self.n) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if not is_int(self.seed):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        self._check_stop_tokens()
        if self.eos_token_id is not None and (
            not is_int(self.eos_token_id) or self.eos_token_id < 0
        ):
            raise ValueError(f"eos_token_id must be None or an int >= 0, got {self.eos_token_id!r}")

    def _check_stop_tokens(self) -> None:
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise ValueError(
                f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}"
            ) from None
        bad = [t for t in stop if not is_int(t) or t < 0]
        if bad:
            raise ValueError(f"stop_token_ids must hold ints >= 0, got {bad[0]!r}")
        object.__setattr__(self, "stop_token_ids", stop)  # lists become tuples: stays hashable

    @classmethod
    def from_config(
        cls, rollout, *, seed: int, n: int | None = None, eos_token_id: int | None = None
    ) -> SamplingParams:
        """The sampling of a run's `rollout` config section (n defaults to samples_per_prompt)."""
        keys = {f.name: getattr(rollout, f.name) for f in fields(SamplingKeys)}
        return cls(
            **keys,
            n=rollout.samples_per_prompt if n is None else n,
            seed=seed,
            eos_token_id=eos_token_id if isinstance(eos_token_id, int) else None,
        )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def logprob_temperature(self) -> float:
        """The T of softmax(logits / T) that recorded logprobs refer to (1.0 for greedy)."""
        return 1.0 if self.greedy else float(self.temperature)

    def stops_on(self, token: int) -> bool:
        return token == self.eos_token_id or token in self.stop_token_ids


KEY_BITS = 63  # keys fit a signed int64 (vLLM's per-request seed, torch's manual_seed)
UNIFORM_BITS = 53  # a float64's mantissa: every uniform is exactly k / 2**53


def _key_of(text: str) -> int:
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> (64 - KEY_BITS)


def request_key(seed: int, prompt_index: int, sample_index: int) -> int:
    """The 63-bit key of one request (sample `sample_index` of prompt `prompt_index`) that
    keys its token draws; stable across runs, processes and platforms."""
    return _key_of(f"{seed}/{prompt_index}/{sample_index}")


def turn_key(seed: int, episode: int, turn: int) -> int:
    """The key of one model turn of an episode (turns from 1): a function of (seed, episode
    index, turn) alone, so a turn's draws depend on no slot, batch or engine."""
    return _key_of(f"{seed}/episode/{episode}/turn/{turn}")


def token_uniform(key: int, index: int) -> float:
    """The uniform in [0, 1) that draws the token at `index` (from 0) of the request `key`:
    the top 53 bits of blake2b("key/index") over 2**53. A pure function, so the draw of a
    position never depends on which draws came before it, here or in another process."""
    if not is_int(key) or not 0 <= key < 2**KEY_BITS:
        raise ValueError(f"token_uniform: key must be an int in [0, 2**{KEY_BITS}), got {key!r}")
    if not is_int(index) or index < 0:
        raise ValueError(f"token_uniform: index must be an int >= 0, got {index!r}")
    digest = hashlib.blake2b(f"{key}/{index}".encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> (64 - UNIFORM_BITS)) / 2**UNIFORM_BITS


def candidates(
    logp: torch.Tensor, top_k: int, top_p: float
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Restrict one row to the drawable tokens: (their logprobs (C,), their ids (C,) or None = all).

    logp: (V,) fp32 logprobs of one row. top_k keeps the k most likely tokens;
    top_p then keeps the smallest prefix (by descending probability) whose
    mass reaches top_p (the token that crosses the threshold is kept).
    """
    ids = None
    if top_k and top_k < logp.shape[0]:
        logp, ids = torch.topk(logp, top_k)  # sorted descending
    if top_p < 1.0:
        if ids is None:
            logp, ids = torch.sort(logp, descending=True)
        mass = logp.double().exp().cumsum(0)  # (C,)
        keep = int(torch.searchsorted(mass, torch.tensor(top_p, dtype=torch.float64))) + 1
        logp, ids = logp[:keep], ids[:keep]
    return logp, ids


def draw(logp: torch.Tensor, u: float) -> int:
    """Inverse-CDF draw of one index from unnormalised logprobs (C,) with the uniform `u`."""
    if not isinstance(u, float) or not 0.0 <= u < 1.0:
        raise ValueError(f"draw: the uniform u must be a float in [0, 1), got {u!r}")
    # exp(logp - max) in fp64, then its running sum: in place in one new (C,) buffer (a
    # large vocabulary's fresh buffers cost more than the arithmetic). The bits are those of
    # (logp.double() - logp.max().double()).exp().cumsum(0): the max is exact, and the scan
    # reads each element before it writes it (tests/rollout/test_sampling.py).
    weights = logp.double()
    weights.sub_(weights.max()).exp_()
    cdf = torch.cumsum(weights, 0, out=weights)
    target = torch.tensor(u, dtype=torch.float64) * cdf[-1]
    index = int(torch.searchsorted(cdf, target, right=True))
    return min(index, cdf.shape[0] - 1)


def sample_token(logp: torch.Tensor, params: SamplingParams, u: float) -> int:
    """One token id from one row of logprobs (V,) (already at the sampling temperature),
    drawn with the uniform `u` (`token_uniform`; greedy ignores it)."""
    if params.greedy:
        return int(torch.argmax(logp))
    cand_logp, cand_ids = candidates(logp, params.top_k, params.top_p)
    index = draw(cand_logp, u)
    return index if cand_ids is None else int(cand_ids[index])
