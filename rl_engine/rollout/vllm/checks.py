"""What the exact vLLM model refuses: every setting under which vLLM's bits would not be
the trainer's raises `ExactVllmUnsupported`, naming the setting (fail closed)."""

from __future__ import annotations

import torch

from rl_engine.patching import family_for

# The architectures whose Hugging Face class the trainer patches as a dense decoder.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


class ExactVllmUnsupported(NotImplementedError):
    """A vLLM model, dtype or feature under which vLLM cannot return the trainer's bits."""


def check_vllm_config(vllm_config) -> None:
    """Raise ExactVllmUnsupported for the first setting the exact model cannot honour."""
    model_config = vllm_config.model_config
    _check_architecture(model_config.hf_config)
    if model_config.dtype not in SUPPORTED_DTYPES:
        _refuse(f"dtype {model_config.dtype}", "fp32 and bf16 are supported")
    if model_config.quantization is not None or vllm_config.quant_config is not None:
        _refuse(f"quantization {model_config.quantization!r}", "weights must stay dense")
    if vllm_config.lora_config is not None:
        _refuse("LoRA (enable_lora)", "the trainer's LoRA path is not wired into vLLM")
    if vllm_config.speculative_config is not None:
        _refuse("speculative decoding (speculative_config)", "draft tokens are not exact")
    if vllm_config.cache_config.cache_dtype != "auto":
        _refuse(
            f"kv_cache_dtype {vllm_config.cache_config.cache_dtype!r}",
            "keys must be stored in the model dtype ('auto')",
        )
    if model_config.logprobs_mode != "raw_logprobs":
        _refuse(
            f"logprobs_mode {model_config.logprobs_mode!r}",
            "the exact logprob is 'raw_logprobs' (log_softmax of the raw logits)",
        )
    parallel = vllm_config.parallel_config
    if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
        _refuse(
            f"tensor_parallel_size={parallel.tensor_parallel_size}, "
            f"pipeline_parallel_size={parallel.pipeline_parallel_size}",
            "one process holds the whole model",
        )
    if getattr(model_config, "enable_prompt_embeds", False):
        _refuse("enable_prompt_embeds", "the model starts from token ids")
    _check_head_size(model_config.get_head_size())


def _check_architecture(hf_config) -> None:
    """The family first (its error says why: mixture of experts, sliding window, an unknown
    model_type), then the HF class vLLM would run."""
    try:
        family = family_for(hf_config)
    except NotImplementedError as err:
        raise ExactVllmUnsupported(f"{ENV_HINT}: {err}") from err
    if family.moe is not None:
        _refuse(f"mixture-of-experts model_type {family.model_type!r}", "dense decoders only")
    architectures = list(getattr(hf_config, "architectures", None) or [])
    unsupported = [a for a in architectures if a not in SUPPORTED_ARCHITECTURES]
    if not architectures or unsupported:
        _refuse(
            f"architecture {architectures or '(none in config.json)'}",
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}",
        )


def _check_head_size(head_size: int) -> None:
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_head_sizes()
    if head_size not in sizes:
        _refuse(f"head size {head_size}", f"vLLM's CPU KV cache takes {sizes}")


def check_attention_metadata(layer_name: str, metadata) -> None:
    """The attention reads vLLM's CPU backend's metadata and cache layout: any other
    backend, or a non-causal / encoder layout, is refused."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionMetadata

    if not isinstance(metadata, CPUAttentionMetadata):
        _refuse(
            f"attention backend metadata {type(metadata).__name__} of layer {layer_name!r}",
            "only vLLM's CPU_ATTN paged KV layout is read",
        )
    if metadata.causal is not True or metadata.dynamic_causal is not None:
        _refuse(f"non-causal attention in layer {layer_name!r}", "decoders only")


ENV_HINT = "RL_ENGINE_BATCH_INVARIANT=1 (exact vLLM logprobs)"


def _refuse(what: str, why: str) -> None:
    raise ExactVllmUnsupported(f"{ENV_HINT} does not support {what}: {why}")
