"""The only layer that knows Hugging Face module classes.

`apply_batch_invariant(model, *, backend=None)` swaps a supported causal LM's
ops for the invariant kernels of its device's backend and returns a handle
with `revert()`; `model_op(model, name)` is the op that model computes with.
`RoutingRecorder(model)` records a mixture-of-experts model's routing.
"""

from rl_engine.patching.apply import (
    apply_batch_invariant,
    lm_head_parameters,
    model_op,
    parameter_device,
)
from rl_engine.patching.attention import (
    KV_CACHE_KWARG,
    PACKED_KWARG,
    PackedSegments,
    attention_name,
)
from rl_engine.patching.decode_path import FastDecoder, fast_decoder
from rl_engine.patching.families import FAMILIES, family_for
from rl_engine.patching.handle import PatchHandle, is_patched, patch_handle
from rl_engine.patching.modules import InvariantLMHead
from rl_engine.patching.moe import (
    RouterCall,
    RoutingRecorder,
    is_experts,
    is_router,
    moe_layers,
    router_settings,
)

__all__ = [
    "FAMILIES",
    "KV_CACHE_KWARG",
    "PACKED_KWARG",
    "FastDecoder",
    "InvariantLMHead",
    "PackedSegments",
    "PatchHandle",
    "apply_batch_invariant",
    "attention_name",
    "family_for",
    "fast_decoder",
    "is_patched",
    "lm_head_parameters",
    "model_op",
    "parameter_device",
    "patch_handle",
    "RouterCall",
    "RoutingRecorder",
    "is_experts",
    "is_router",
    "moe_layers",
    "router_settings",
]
