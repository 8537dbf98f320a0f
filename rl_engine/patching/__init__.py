"""The only layer that knows Hugging Face module classes.

`apply_batch_invariant(model)` swaps a supported causal LM's ops for the
invariant kernels and returns a handle with `revert()`.
"""

from rl_engine.patching.apply import (
    InvariantLMHead,
    PatchHandle,
    apply_batch_invariant,
    is_patched,
    lm_head_parameters,
)
from rl_engine.patching.attention import ATTENTION_NAME, KV_CACHE_KWARG
from rl_engine.patching.families import FAMILIES, family_for

__all__ = [
    "ATTENTION_NAME",
    "FAMILIES",
    "KV_CACHE_KWARG",
    "InvariantLMHead",
    "PatchHandle",
    "apply_batch_invariant",
    "family_for",
    "is_patched",
    "lm_head_parameters",
]
