"""Diagnostics: how far rollout and trainer disagree and where it starts (logprob mismatch,
first divergence, routing agreement), and whether the GPU kernels compile to binaries that can
keep the bits (`gpu_compile`: the command of scripts/compile_gpu_kernels.py)."""

from rl_engine.logprobs.parity import MismatchMetrics, first_mismatch, mismatch_metrics

__all__ = ["MismatchMetrics", "first_mismatch", "mismatch_metrics"]
