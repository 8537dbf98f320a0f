"""Drop-in modules that call the ops `apply_batch_invariant` resolved for the model's device.

Each module holds the *function* the registry returned (never a backend
import) and the original Parameter objects, so optimizers, DeepSpeed and tied
weights keep working. Every forward first checks that its parameters are
still on the device type the model was patched for: ops are resolved per
device, so a model moved after patching must be patched again.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn


def check_patched_device(module: nn.Module, tensor: torch.Tensor) -> None:
    """Raise if `tensor` (a parameter or input) left the device type the ops were resolved for."""
    if tensor.device.type != module.device_type:
        raise RuntimeError(
            f"{type(module).__name__}: the model was patched for {module.device_type!r} "
            f"(backend {module.backend!r}) but now runs on {tensor.device}; ops are resolved "
            "per device: revert() the patch, move the model, then apply_batch_invariant again"
        )


class PatchedOp(nn.Module):
    """Common state: the resolved op, its backend and the device type it was resolved for."""

    def __init__(self, op: Callable, backend: str, device_type: str):
        super().__init__()
        self.op, self.backend, self.device_type = op, backend, device_type
        self.gradient_route = None  # layout-invariant training (patching/gradient_route.py)

    def route(self, x: torch.Tensor) -> dict:
        """`spans=` / `sink=` for the op on input `x` (its leading dims are the rows) when a
        layout-invariant step routes this forward."""
        if self.gradient_route is None:
            return {}
        return self.gradient_route.decoder_kwargs(math.prod(x.shape[:-1]))

    def _tags(self) -> str:
        return f"backend={self.backend}, batch_invariant=True"


class InvariantEmbedding(PatchedOp):
    """Replaces `nn.Embedding` (scaled embeddings keep their scale)."""

    def __init__(self, base: nn.Embedding, op: Callable, backend: str, device_type: str):
        super().__init__(op, backend, device_type)
        self.num_embeddings, self.embedding_dim = base.num_embeddings, base.embedding_dim
        self.padding_idx = base.padding_idx
        self.weight = base.weight
        self._scale = getattr(base, "embed_scale", None)  # scaled embeddings (e.g. Gemma-style)

    def forward(self, ids):
        check_patched_device(self, self.weight)
        out = self.op(ids, self.weight, self.padding_idx, **self._ids_route(ids))
        if self._scale is not None:
            out = out * self._scale.to(out.dtype)
        return out

    def _ids_route(self, ids: torch.Tensor) -> dict:
        if self.gradient_route is None:
            return {}
        return self.gradient_route.decoder_kwargs(ids.numel())

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, {self._tags()}"


class InvariantLinear(PatchedOp):
    """Replaces `nn.Linear` (x.dtype output) or the vocabulary projection (fp32 logits)."""

    def __init__(self, base: nn.Linear, op: Callable, backend: str, device_type: str):
        super().__init__(op, backend, device_type)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias

    def forward(self, x):
        check_patched_device(self, self.weight)
        return self.op(x, self.weight, self.bias, **self.route(x))

    def extra_repr(self):
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}, {self._tags()}"
        )


class InvariantLMHead(InvariantLinear):
    """Vocabulary projection returning fp32 logits; shares the original weight (tied or not)."""

    def extra_repr(self):
        return f"in_features={self.in_features}, vocab={self.out_features}, fp32_logits=True, {self._tags()}"


class InvariantRMSNorm(PatchedOp):
    """Replaces HF `*RMSNorm` modules (weight and variance_epsilon / eps)."""

    def __init__(self, base: nn.Module, op: Callable, backend: str, device_type: str):
        super().__init__(op, backend, device_type)
        self.weight = base.weight
        self.eps = getattr(base, "variance_epsilon", getattr(base, "eps", 1e-6))

    def forward(self, x):
        check_patched_device(self, self.weight)
        return self.op(x, self.weight, self.eps, **self.route(x))

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.eps}, {self._tags()}"


class InvariantSiLU(PatchedOp):
    """Replaces the MLP activation."""

    def forward(self, x):
        check_patched_device(self, x)
        return self.op(x)

    def extra_repr(self):
        return self._tags()
