"""The handle a patched model carries (patching/handle.py).

What it checks: an unpatched model has no handle; a patched one has the handle
`apply_batch_invariant` returned, which names its backend, device type and ops and counts its
replacements by kind; `revert()` puts every original module back (the same objects), detaches
the handle, and is harmless a second time.
"""

from __future__ import annotations

from torch import nn

from rl_engine.models import load_model
from rl_engine.patching import PatchHandle, apply_batch_invariant, is_patched, patch_handle


def test_a_patched_model_carries_its_handle_and_revert_detaches_it():
    model, _ = load_model("tiny-llama", seed=0)
    assert patch_handle(model) is None and not is_patched(model)
    originals = {name: m for name, m in model.named_modules()}
    handle = apply_batch_invariant(model)
    assert isinstance(handle, PatchHandle) and patch_handle(model) is handle and is_patched(model)
    assert (handle.backend, handle.device_type, handle.model) == ("cpp", "cpu", model)
    assert handle.ops["linear"] is model.model.layers[0].self_attn.q_proj.op
    handle.revert()
    assert not handle.active and patch_handle(model) is None and not is_patched(model)
    assert {name: m for name, m in model.named_modules()} == originals
    handle.revert()  # a second revert changes nothing
    assert not is_patched(model)


def test_the_summary_counts_replacements_by_kind():
    handle = PatchHandle(
        model=nn.Linear(1, 1),
        backend="cpp",
        device_type="cpu",
        ops={},
        layout=None,
        attention_name="x",
        replaced=["linear:a", "linear:b", "rms_norm:c", "lm_head:d"],
    )
    assert handle.summary() == {"linear": 2, "rms_norm": 1, "lm_head": 1}
