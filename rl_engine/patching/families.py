"""Which Hugging Face architectures can be patched, and what each one needs.

Every supported family is a Llama-style decoder: token embedding, RMSNorm,
q/k/v/o and gate/up/down `nn.Linear` projections, a SiLU-gated MLP, rotary
positions, and a vocabulary projection that may be tied to the embedding.
Adding a family is adding an entry here (see docs/adding-a-model-family.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Family:
    """What the patcher must know about one `config.model_type`."""

    model_type: str
    """transformers' `config.model_type`."""
    norm_class_suffix: str = "RMSNorm"
    """Module classes whose name ends with this are replaced by the invariant RMSNorm."""
    activations: tuple[str, ...] = ("silu",)
    """Values of `config.hidden_act` the invariant MLP supports."""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("qwen2"),
        Family("qwen3"),  # q_norm / k_norm are RMSNorms too
        Family("mistral"),
    )
}


def family_for(config) -> Family:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise NotImplementedError(
            f"batch-invariant patching does not support model_type {model_type!r}; "
            f"supported: {', '.join(sorted(FAMILIES))}"
        )
    family = FAMILIES[model_type]
    if getattr(config, "hidden_act", "silu") not in family.activations:
        raise NotImplementedError(
            f"{model_type}: hidden_act {config.hidden_act!r} is not supported; supported: {family.activations}"
        )
    if _uses_sliding_window(config):
        raise NotImplementedError(
            f"{model_type}: sliding-window attention (sliding_window={config.sliding_window}) is not "
            "supported by the invariant attention; set config.sliding_window = None"
        )
    return family


def _uses_sliding_window(config) -> bool:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return False
    if hasattr(config, "use_sliding_window"):  # qwen2/qwen3 carry a window size they do not use
        return bool(config.use_sliding_window)
    return window < getattr(config, "max_position_embeddings", window + 1)
