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
Every request (prompt index p, sample index s) owns a `torch.Generator` seeded
from (seed, p, s), and a token is drawn from that request's row alone with ops
on a 1-D tensor. The draw therefore depends neither on the other rows of the
batch nor on the batch size: same prompt, same index, same seed -> same
completion. A model turn of a multi-turn episode owns the generator of (seed, episode
index, turn) instead (`turn_generator`): its draws depend on no slot, batch or engine.
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
    the generator are unused); its logprobs are recorded at T = 1.
    eos_token_id None means: do not stop on an EOS token (only on `stop_token_ids`).
    """

    n: int = 1
    """Completions per prompt (vLLM's name; the config's `rollout.samples_per_prompt`)."""
    seed: int = 0
    """Seed of the generator that draws the samples."""
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


def request_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """A 63-bit seed that mixes (seed, prompt index, sample index); stable across runs and platforms."""
    digest = hashlib.blake2b(
        f"{seed}/{prompt_index}/{sample_index}".encode(), digest_size=8
    ).digest()
    return int.from_bytes(digest, "little") >> 1


def request_generator(seed: int, prompt_index: int, sample_index: int) -> torch.Generator:
    """The CPU generator owned by one request (draws are tiny; they stay on the CPU)."""
    return torch.Generator(device="cpu").manual_seed(request_seed(seed, prompt_index, sample_index))


def turn_generator(seed: int, episode: int, turn: int) -> torch.Generator:
    """The generator of one model turn of an episode (turns from 1): a function of (seed,
    episode index, turn) alone, so a turn's draws depend on no slot, batch or engine."""
    digest = hashlib.blake2b(f"{seed}/episode/{episode}/turn/{turn}".encode(), digest_size=8)
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest.digest(), "little") >> 1)


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


def draw(logp: torch.Tensor, generator: torch.Generator) -> int:
    """Inverse-CDF draw of one index from unnormalised logprobs (C,), with one uniform of `generator`."""
    weights = (logp.double() - logp.max().double()).exp()  # (C,), max weight 1
    cdf = weights.cumsum(0)
    u = torch.rand((), generator=generator, dtype=torch.float64)
    index = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    return min(index, cdf.shape[0] - 1)


def sample_token(logp: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """One token id from one row of logprobs (V,) (already at the sampling temperature)."""
    if params.greedy:
        return int(torch.argmax(logp))
    cand_logp, cand_ids = candidates(logp, params.top_k, params.top_p)
    index = draw(cand_logp, generator)
    return index if cand_ids is None else int(cand_ids[index])
