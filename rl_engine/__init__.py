"""rl_engine: exact on-policy RL training for Hugging Face causal LMs.

Batch-invariant kernels make the trainer's per-token logprobs equal the
rollout engine's bit for bit; see docs/architecture.md.
"""

__version__ = "0.1.0"
