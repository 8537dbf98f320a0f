"""The machine's limit for one decode step, measured in the process that runs the step.

A decode step of batch B at context length L must at least
- move its bytes: every weight read once (the input embedding only at B rows, unless it is
  the LM head's weight) and the keys and values the attention reads, 2 x layers x Hkv x D x L
  values per sequence in the KV cache's dtype (the cpp backend keeps bf16 models' cache in
  fp32); at the bandwidth of a STREAM-like copy probe (`copy_bandwidth`: a large fp32 tensor
  copied, bytes read + written over the best time);
- do its FLOPs: 2 x B per weight of every projection and the LM head, plus the attention's
  2 x 2 x Hq x D x L per sequence and layer; at the peak of the backend's GEMM at the step's
  own shapes (`gemm_peak`: the cpp GEMM on [B, in] x [in, out] for each projection of one
  layer, on weights packed once as the engine's decode runs it, weights hot in cache, FLOPs
  over the best times).

limit = max(bytes / bandwidth, FLOPs / peak) seconds a step; a measured rate is reported as
its fraction of B / limit tokens per second. Activations, norms and sampling are left out:
the limit is a floor, not a model of the step.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
from torch import nn

from rl_engine.kernels import backend_layout, get_op

GB = 1e9


def best_seconds(fn, repeats: int) -> float:
    """Best wall time of `repeats` calls of `fn` after one warm-up call."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def copy_bandwidth(mib: int = 512, repeats: int = 5) -> float:
    """GB/s of `dst.copy_(src)` on fp32 tensors of `mib` MiB each (read + write counted), best
    of `repeats`, at torch's current intra-op thread count. Far larger than the caches, so
    it measures memory, not cache."""
    n = mib * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    seconds = best_seconds(lambda: dst.copy_(src), repeats)
    return 2 * src.numel() * src.element_size() / seconds / GB


@dataclass(frozen=True)
class ModelShape:
    """What a decode step's bytes and FLOPs depend on."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    projections: tuple[tuple[int, int], ...]  # (in, out) of every linear of one layer
    weight_bytes: int  # read once per step
    linear_weights: int  # elements of every projection of every layer and the LM head
    kv_bytes: int  # bytes of one cached key or value element

    @classmethod
    def of(cls, model: nn.Module, *, patched: bool) -> ModelShape:
        config = model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        layer = model.base_model.layers[0]
        shapes = tuple(
            (m.in_features, m.out_features)
            for m in layer.modules()
            if isinstance(getattr(m, "weight", None), torch.Tensor)
            and hasattr(m, "in_features")
            and hasattr(m, "out_features")
        )
        head = model.get_output_embeddings().weight
        dtype = head.dtype
        kv_dtype = dtype
        if patched and backend_layout("cpu").kv_in_compute_dtype:
            kv_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            heads=heads,
            kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            projections=shapes,
            weight_bytes=_weight_bytes(model),
            linear_weights=config.num_hidden_layers * sum(i * o for i, o in shapes) + head.numel(),
            kv_bytes=torch.finfo(kv_dtype).bits // 8,
        )

    def step_bytes(self, batch: int, context: float) -> float:
        """Bytes a decode step of `batch` sequences at mean context `context` reads."""
        kv = 2 * self.layers * self.kv_heads * self.head_dim * context * self.kv_bytes
        return self.weight_bytes + batch * kv

    def step_flops(self, batch: int, context: float) -> float:
        attention = 2 * 2 * self.layers * self.heads * self.head_dim * context
        return batch * (2 * self.linear_weights + attention)


def _weight_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter, the input embedding left out unless the LM head
    reads it (a decode step reads B of its rows)."""
    embedding = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    seen, total = set(), 0
    for param in model.parameters():
        if id(param) in seen or (param is embedding and head is not embedding):
            continue
        seen.add(id(param))
        total += param.numel() * param.element_size()
    return total


def gemm_peak(shape: ModelShape, batch: int, dtype: torch.dtype, repeats: int = 10) -> float:
    """GFLOP/s of the cpu backend's GEMM as the engine's decode runs it over one layer's
    projections at batch `batch` (FLOPs over the sum of their best times), weights hot in
    cache: on weights packed once where the backend packs them (`weight_packing`, the
    FastDecoder's path), else the `linear` op."""
    linear = get_op("linear", "cpu")
    packing = backend_layout("cpu").weight_packing
    g = torch.Generator().manual_seed(0)
    flops = seconds = 0.0
    for fan_in, fan_out in shape.projections:
        x = torch.randn(batch, fan_in, generator=g).to(dtype)
        w = torch.randn(fan_out, fan_in, generator=g).to(dtype)
        if packing is not None and packing.packs(w):
            call = functools.partial(packing.project, x, packing.pack(w))
        else:
            call = functools.partial(linear, x, w)
        seconds += best_seconds(call, repeats)
        flops += 2 * batch * fan_in * fan_out
    return flops / seconds / GB


@dataclass(frozen=True)
class Roofline:
    """The limit of one decode step (see the module docstring)."""

    batch: int
    step_bytes: float
    bandwidth: float  # GB/s
    step_flops: float
    peak: float  # GFLOP/s

    @property
    def memory_seconds(self) -> float:
        return self.step_bytes / (self.bandwidth * GB)

    @property
    def compute_seconds(self) -> float:
        return self.step_flops / (self.peak * GB)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_seconds >= self.compute_seconds else "compute"

    @property
    def tokens_per_second(self) -> float:
        """The most decode tokens a second the step's bytes and FLOPs allow."""
        return self.batch / max(self.memory_seconds, self.compute_seconds)

    def fraction(self, rate: float) -> float:
        """A measured decode rate (tokens/s) as a fraction of the limit."""
        return rate / self.tokens_per_second


def decode_roofline(
    shape: ModelShape, batch: int, context: float, dtype, bandwidth: float, repeats: int = 10
) -> Roofline:
    """The limit of a decode step of `batch` sequences at mean context `context`."""
    return Roofline(
        batch=batch,
        step_bytes=shape.step_bytes(batch, context),
        bandwidth=bandwidth,
        step_flops=shape.step_flops(batch, context),
        peak=gemm_peak(shape, batch, dtype, repeats),
    )
