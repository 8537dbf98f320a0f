"""Which Hugging Face architectures can be patched, and what each one needs.

Every supported family is a Llama-style decoder: token embedding, RMSNorm,
q/k/v/o and gate/up/down `nn.Linear` projections, a SiLU-gated MLP, rotary
positions, and a vocabulary projection that may be tied to the embedding.
Mixture-of-experts families (`moe` set) replace some or all MLPs by a sparse
block: a `*TopKRouter` and an `*Experts` module holding the 3-D expert weights
(transformers >= 5), optionally a shared expert behind a sigmoid gate.
Adding a family is adding an entry here (see docs/adding-a-model-family.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """How one family's sparse-MoE blocks route and weight their experts (HF's own choices)."""

    renormalize: bool | None
    """Renormalise the top-k weights: True / False, or None to follow `config.norm_topk_prob`."""
    weights_in_model_dtype: bool
    """HF casts the routing weights back to the logits' dtype; False: they stay fp32 (Mixtral)."""
    shared_expert: bool = False
    """The block adds a shared expert scaled by sigmoid(shared_expert_gate(x)) (Qwen2-MoE)."""
    router_class_suffix: str = "TopKRouter"
    """Router modules: classes whose name ends with this (they return logits, weights, ids)."""
    experts_class_suffix: str = "Experts"
    """Expert modules: classes whose name ends with this (3-D gate_up_proj / down_proj)."""
    block_class_suffix: str = "SparseMoeBlock"
    """The block holding router and experts (replaced only when `shared_expert`)."""


@dataclass(frozen=True, slots=True)
class Family:
    """What the patcher must know about one `config.model_type`."""

    model_type: str
    """transformers' `config.model_type`."""
    norm_class_suffix: str = "RMSNorm"
    """Module classes whose name ends with this are replaced by the invariant RMSNorm."""
    activations: tuple[str, ...] = ("silu",)
    """Values of `config.hidden_act` the invariant MLP supports."""
    moe: MoeSpec | None = None
    """Sparse mixture-of-experts blocks, or None for a dense decoder."""


FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("llama"),
        Family("qwen2"),
        Family("qwen3"),  # q_norm / k_norm are RMSNorms too
        Family("mistral"),
        # dense MLPs where mlp_only_layers / decoder_sparse_step say so: patched as dense
        Family("qwen3_moe", moe=MoeSpec(renormalize=None, weights_in_model_dtype=True)),
        Family(
            "qwen2_moe",
            moe=MoeSpec(renormalize=None, weights_in_model_dtype=True, shared_expert=True),
        ),
        Family("mixtral", moe=MoeSpec(renormalize=True, weights_in_model_dtype=False)),
        Family("olmoe", moe=MoeSpec(renormalize=None, weights_in_model_dtype=True)),
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
    if family.moe is not None and (getattr(config, "router_jitter_noise", None) or 0) > 0:
        raise NotImplementedError(
            f"{model_type}: router_jitter_noise={config.router_jitter_noise} multiplies the "
            "hidden states by fresh random noise in training: the trainer could never equal the "
            "rollout; set config.router_jitter_noise = 0"
        )
    return family


def _uses_sliding_window(config) -> bool:
    window = getattr(config, "sliding_window", None)
    if window is None:
        return False
    if hasattr(config, "use_sliding_window"):  # qwen2/qwen3 carry a window size they do not use
        return bool(config.use_sliding_window)
    return window < getattr(config, "max_position_embeddings", window + 1)
