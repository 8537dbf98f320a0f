"""`SpeculativeParams`: how the engine speculates (`rollout.speculative` in a run config)."""

from __future__ import annotations

from dataclasses import dataclass

from rl_engine.base.fields import check_choice, check_int

METHODS = ("ngram", "draft_model")
"""How drafts are proposed: prompt lookup (no second model) or a draft causal LM."""


@dataclass(frozen=True, kw_only=True)
class SpeculativeParams:
    """Speculative decoding: up to `num_tokens` drafts per running sequence and decode step,
    verified by the policy in one forward; the tokens and logprobs stay those of plain
    decoding (verify.py says why)."""

    method: str
    """'ngram' (prompt lookup: the tokens that followed the latest earlier occurrence of the
    sequence's last n tokens) or 'draft_model' (a causal LM with the policy's vocabulary)."""
    num_tokens: int
    """k: most draft tokens per sequence and step (k + 1 positions verified per forward)."""
    ngram_max: int = 3
    """ngram: the longest suffix looked up (tried first)."""
    ngram_min: int = 2
    """ngram: the shortest suffix looked up (a 1-token suffix recurs often and drafts badly)."""
    max_batch: int = 4
    """Speculate only in decode steps of at most this many sequences: the long tail of a step.
    A verifying forward computes k + 1 positions per sequence, which pays only while the
    weights' reads, not the arithmetic, bound the step."""
    model: str | None = None
    """draft_model: the draft's `load_model` spec (a job loads and patches it; an engine built
    in code takes the module instead)."""

    def __post_init__(self) -> None:
        _check(vars(self), "speculative.")

    @classmethod
    def from_dict(cls, data: dict, section: str = "rollout.speculative.") -> SpeculativeParams:
        """From a config mapping; an unknown key is named."""
        if not isinstance(data, dict):
            raise ValueError(f"{section.rstrip('.')} must be a mapping, got {data!r}")
        known = {"method", "num_tokens", "ngram_max", "ngram_min", "max_batch", "model"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"unknown key {section}{unknown[0]} (known: {', '.join(sorted(known))})"
            )
        for key in ("method", "num_tokens"):
            if key not in data:
                raise ValueError(f"{section}{key} is required")
        _check({**_DEFAULTS, **data}, section)
        if data["method"] == "draft_model" and data.get("model") is None:
            raise ValueError(f"{section}model is required with method: draft_model")
        return cls(**data)


_DEFAULTS = {"ngram_max": 3, "ngram_min": 2, "max_batch": 4, "model": None}


def _check(values: dict, section: str) -> None:
    """Raise a ValueError naming the first bad key, prefixed by `section`."""
    check_choice(f"{section}method", values["method"], METHODS)
    check_int(f"{section}num_tokens", values["num_tokens"], 1)
    check_int(f"{section}ngram_min", values["ngram_min"], 1)
    check_int(f"{section}ngram_max", values["ngram_max"], values["ngram_min"])
    check_int(f"{section}max_batch", values["max_batch"], 1)
    model = values["model"]
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"{section}model must be a load_model spec (a string), got {model!r}")
