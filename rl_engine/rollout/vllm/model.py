"""`ExactCausalLM`: vLLM's model class under `RL_ENGINE_BATCH_INVARIANT=1`.

One definition of the model: it builds the trainer's Hugging Face model from the
folder vLLM serves (`load_skeleton`, as `load_model` builds it), copies vLLM's
weights into it and patches it with `apply_batch_invariant`, so every op
(embedding, RMSNorm with HF's residual order, separate q/k/v and gate/up linears,
HF's rotary, SiLU-and-mul, attention, final norm, lm_head) is the kernel
`get_op(name, device)` gives the trainer. vLLM's `Attention` layers exist only so
that vLLM sizes, allocates and binds a paged KV cache per decoder layer; rl_engine's
attention op reads and writes it, never vLLM's kernels. On the cpp backend the forward
is the patched model's `FastDecoder` (its ops in their order, GEMM weights packed:
the same bits) over `PagedBlockCache` (the attention reads vLLM's blocks in place);
otherwise the patched HF model over `PagedKVCache` (each request's blocks gathered). `compute_logits` is the patched
model's lm_head op; vLLM's raw logprobs, log_softmax in fp32, are then the
trainer's `log_softmax` op (native: the same `torch.log_softmax` of fp32 logits).

Not decorated with vLLM's `support_torch_compile`: vLLM runs it eager, so no
compiler fuses or reorders its ops.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from rl_engine.models.loading import load_skeleton
from rl_engine.patching import (
    KV_CACHE_KWARG,
    FastDecoder,
    apply_batch_invariant,
    fast_decoder,
    lm_head_parameters,
    model_op,
    patch_handle,
)
from rl_engine.patching.packed_weights import PackedWeights
from rl_engine.rollout.vllm.checks import check_vllm_config
from rl_engine.rollout.vllm.paged import FlatBatch, PagedKVCache
from rl_engine.rollout.vllm.paged_blocks import BLOCK_TABLE_BACKENDS, PagedBlockCache

HF_ATTRIBUTE = "hf"


class ExactCausalLM(nn.Module):
    """vLLM text-generation model that runs the trainer's patched HF model."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__()
        check_vllm_config(vllm_config)
        model_config = vllm_config.model_config
        hf, _ = load_skeleton(model_config.model, dtype=model_config.dtype)
        self.hf = hf
        self.config = hf.config
        self.attn_layers = _attention_layers(vllm_config, hf.config, prefix)
        self.layer_names = [layer.layer_name for layer in self.attn_layers]
        self._lm_head = self._log_softmax = None  # the patched ops, once weights are in
        self._packed = PackedWeights()
        self._decoder: FastDecoder | None = None  # built at the first forward after new weights
        self._decoder_built = False
        self.sample_positions: torch.Tensor | None = None
        """(R,) the last scheduled position of each request of the last forward (the
        position whose logits are sampled): read by ExactSampler."""

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.hf.get_input_embeddings()(input_ids)

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """vLLM's flat tokens (N,) -> final-norm hidden states (N, H)."""
        from vllm.forward_context import get_forward_context

        if inputs_embeds is not None or input_ids is None:
            raise NotImplementedError(
                "RL_ENGINE_BATCH_INVARIANT=1: inputs_embeds are not supported"
            )
        total = positions.shape[0]
        metadata = get_forward_context().attn_metadata
        self.sample_positions = None
        if metadata is None:  # vLLM's warm-up / profiling run: no KV cache to attend over
            return torch.zeros(total, self.config.hidden_size, dtype=self._dtype())
        if isinstance(metadata, list):
            raise NotImplementedError(
                "RL_ENGINE_BATCH_INVARIANT=1: speculative-decoding metadata is not supported"
            )
        batch = FlatBatch.from_metadata(metadata[self.layer_names[0]], positions)
        self.sample_positions = batch.q_positions.max(dim=1).values
        if batch.count == 0:
            return torch.zeros(total, self.config.hidden_size, dtype=self._dtype())
        ids, positions = batch.pad_ids(input_ids), batch.q_positions.clamp(min=0)
        decoder = self.decoder()
        if decoder is not None:
            # a prefill chunk beside decodes: only the real tokens are computed (ragged)
            real = batch.q_positions >= 0 if ids.shape[1] > 1 else None
            hidden = decoder(ids, positions, PagedBlockCache(self.layer_names, batch), real)
        else:
            hidden = self.hf.base_model(
                input_ids=ids,
                position_ids=positions,
                use_cache=False,
                **{KV_CACHE_KWARG: PagedKVCache(self.layer_names, batch)},
            ).last_hidden_state
        return batch.flat(hidden, total)

    def decoder(self) -> FastDecoder | None:
        """The patched model's FastDecoder on weights packed now (same ops, same order, the
        same bits: decode_path.py), when the model has one and its attention reads vLLM's
        block table in place; else None: the module path (the patched HF model over the
        gathered keys) runs."""
        if not self._decoder_built:
            handle = patch_handle(self.hf)
            plan = fast_decoder(self.hf) if handle.backend in BLOCK_TABLE_BACKENDS else None
            self._decoder = None if plan is None else plan.packed_into(self._packed)
            self._decoder_built = True
        return self._decoder

    def weights_changed(self) -> None:
        """The parameters were written (a weight sync, load_weights): drop the packed copies,
        the next forward packs the new weights (never a stale panel)."""
        self._decoder, self._decoder_built = None, False
        self._packed.release()

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """(M, H) -> (M, V) logits through the patched lm_head op (the trainer's; on its packed
        weight where the FastDecoder runs: the same bits)."""
        if self._lm_head is None:
            raise RuntimeError("ExactCausalLM.compute_logits before load_weights")
        decoder = self.decoder()
        if decoder is not None:
            return decoder.lm_head(hidden_states)
        weight, bias = lm_head_parameters(self.hf)
        return self._lm_head(hidden_states, weight, bias)

    def log_softmax(self, logits: torch.Tensor, temperature: float) -> torch.Tensor:
        """(M, V) logits -> fp32 logprobs at `temperature`: the trainer's log_softmax op, as
        the own engine's stepper calls it (ExactSampler's logprobs)."""
        if self._log_softmax is None:
            raise RuntimeError("ExactCausalLM.log_softmax before load_weights")
        return self._log_softmax(logits, temperature)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy a checkpoint's tensors into the HF model by name, then patch it."""
        params = dict(self.hf.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name not in params:
                raise ValueError(
                    f"checkpoint tensor {name!r} has no parameter in {type(self.hf).__name__}"
                )
            with torch.no_grad():
                params[name].copy_(tensor)
            loaded.add(f"{HF_ATTRIBUTE}.{name}")
        missing = {f"{HF_ATTRIBUTE}.{n}" for n in params} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks parameters {sorted(missing)}")
        if self._lm_head is None:
            apply_batch_invariant(self.hf)
            self._lm_head = model_op(self.hf, "lm_head")
            self._log_softmax = model_op(self.hf, "log_softmax")
        self.weights_changed()
        return loaded

    def _dtype(self) -> torch.dtype:
        return self.hf.get_input_embeddings().weight.dtype


def _attention_layers(vllm_config, config, prefix: str) -> nn.ModuleList:
    """One vLLM `Attention` per decoder layer, named by its module path: vLLM derives the
    KV cache spec from them and binds each layer's paged cache to it."""
    from vllm.model_executor.layers.attention import Attention

    head_dim = vllm_config.model_config.get_head_size()
    kv_heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
    base = f"{prefix}.attn_layers" if prefix else "attn_layers"
    return nn.ModuleList(
        Attention(
            num_heads=config.num_attention_heads,
            head_size=head_dim,
            scale=head_dim**-0.5,
            num_kv_heads=kv_heads,
            cache_config=vllm_config.cache_config,
            prefix=f"{base}.{i}",
        )
        for i in range(config.num_hidden_layers)
    )
