"""rl_engine: exact on-policy RL training for Hugging Face causal LMs.

Batch-invariant kernels make the trainer's per-token logprobs equal the
rollout engine's bit for bit; see docs/architecture.md.
"""

from rl_engine.base.moved_modules import install as _install_moved_modules

__version__ = "0.1.0"

# The old paths of modules that moved into packages keep importing for one release.
_install_moved_modules()
