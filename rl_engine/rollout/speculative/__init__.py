"""Speculative decoding that keeps every bit: drafts (prompt lookup or a draft model) verified
by the policy in one forward, each token drawn as plain decoding draws it (verify.py)."""

from rl_engine.rollout.speculative.build import (
    SpeculationError,
    attach_speculation,
    check_speculation,
)
from rl_engine.rollout.speculative.params import METHODS, SpeculativeParams
from rl_engine.rollout.speculative.verify import SpeculationCounts, SpeculativeDecode

__all__ = [
    "METHODS",
    "SpeculationCounts",
    "SpeculationError",
    "SpeculativeDecode",
    "SpeculativeParams",
    "attach_speculation",
    "check_speculation",
]
