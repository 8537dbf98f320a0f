"""Logprob-mismatch diagnostics: how far rollout and trainer disagree, and where it starts."""

from rl_engine.logprobs.parity import MismatchMetrics, first_mismatch, mismatch_metrics

__all__ = ["MismatchMetrics", "first_mismatch", "mismatch_metrics"]
