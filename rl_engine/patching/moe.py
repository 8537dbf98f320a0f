"""Mixture-of-experts modules: the invariant router, experts and shared-expert block, and a routing recorder.

`apply_batch_invariant` swaps each HF `*TopKRouter` for `InvariantMoeRouter`
(op `moe_router`), each `*Experts` for `InvariantMoeExperts` (op
`moe_experts`, which never calls HF's `grouped_mm`), and, for families with a
shared expert (Qwen2-MoE), the whole `*SparseMoeBlock` for
`InvariantSharedExpertMoeBlock`, whose sigmoid gate goes through op `sigmoid`
(torch's is not position-invariant). The shared expert's MLP and its gate are
plain `nn.Linear` / `act_fn` modules and are patched like any dense MLP.
Every module keeps the HF module's Parameter objects and its attribute names,
so state_dict keys, optimizers and DeepSpeed ZeRO-3 (which gathers a module's
own parameters when its forward runs) keep working.

`RoutingRecorder(model)` records, for every call of every router of a patched
or unpatched model, its input, logits and chosen experts (and the experts'
output): the worker's auxiliary loss and load metrics, and the diagnostics'
routing agreement, read routing through it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from rl_engine.patching.families import Family, MoeSpec
from rl_engine.patching.modules import PatchedOp, check_patched_device


def routing_options(spec: MoeSpec, config) -> tuple[bool, bool]:
    """(renormalize, weights_in_model_dtype) of one family's routers for `config`."""
    renormalize = spec.renormalize
    if renormalize is None:
        renormalize = bool(getattr(config, "norm_topk_prob", False))
    return renormalize, spec.weights_in_model_dtype


class InvariantMoeRouter(PatchedOp):
    """Replaces HF `*TopKRouter`: hidden (..., H) -> (logits (N, E), weights (N, k), ids (N, k))."""

    def __init__(
        self,
        base: nn.Module,
        op: Callable,
        backend: str,
        device_type: str,
        *,
        renormalize: bool,
        weights_in_model_dtype: bool,
    ):
        super().__init__(op, backend, device_type)
        self.weight = base.weight
        self.top_k, self.num_experts, self.hidden_dim = (
            base.top_k,
            base.num_experts,
            base.hidden_dim,
        )
        self.renormalize, self.weights_in_model_dtype = renormalize, weights_in_model_dtype

    def forward(self, hidden_states):
        check_patched_device(self, self.weight)
        hidden = hidden_states.reshape(-1, self.hidden_dim)  # (N, H)
        # Mixtral keeps its weights in the softmax's fp32 (HF: softmax(logits.float()))
        kept = (
            None
            if self.weights_in_model_dtype
            else torch.promote_types(hidden.dtype, torch.float32)
        )
        return self.op(
            hidden,
            self.weight,
            self.top_k,
            renormalize=self.renormalize,
            weights_dtype=kept,
            **self.route(hidden),
        )

    def extra_repr(self):
        return (
            f"experts={self.num_experts}, top_k={self.top_k}, renormalize={self.renormalize}, "
            f"ties=lowest_index, {self._tags()}"
        )


class InvariantMoeExperts(PatchedOp):
    """Replaces HF `*Experts` (3-D gate_up_proj (E, 2I, H), down_proj (E, H, I), SiLU gate)."""

    def __init__(self, base: nn.Module, op: Callable, backend: str, device_type: str):
        super().__init__(op, backend, device_type)
        check_experts_layout(base)
        self.gate_up_proj, self.down_proj = base.gate_up_proj, base.down_proj
        self.num_experts = base.num_experts
        self.hidden_dim, self.intermediate_dim = base.hidden_dim, base.intermediate_dim

    def forward(self, hidden_states, top_k_index, top_k_weights):
        check_patched_device(self, self.gate_up_proj)
        return self.op(
            hidden_states,
            self.gate_up_proj,
            self.down_proj,
            top_k_index,
            top_k_weights,
            **self.route(hidden_states),
        )

    def extra_repr(self):
        return (
            f"experts={self.num_experts}, hidden={self.hidden_dim}, "
            f"intermediate={self.intermediate_dim}, combine=ascending_expert, {self._tags()}"
        )


def check_experts_layout(base: nn.Module) -> None:
    """The layout the `moe_experts` op computes: concatenated [gate; up], not transposed, no bias,
    a SiLU gate, no post-expert norm, no expert parallelism."""
    name = type(base).__name__
    wanted = {
        "has_gate": True,
        "has_bias": False,
        "is_transposed": False,
        "is_concatenated": True,
        "has_post_expert_norm": False,
        "_is_expert_parallel": False,
    }
    for attr, value in wanted.items():
        if getattr(base, attr, value) != value:
            raise NotImplementedError(
                f"{name}.{attr} is {getattr(base, attr)!r}: the invariant experts support "
                f"{attr}={value} only"
            )
    act = type(getattr(base, "act_fn", None)).__name__
    if "SiLU" not in act:
        raise NotImplementedError(
            f"{name}.act_fn is {act}: the invariant experts support SiLU only"
        )
    if base.gate_up_proj.dim() != 3 or base.down_proj.dim() != 3:
        raise NotImplementedError(f"{name}: expected 3-D gate_up_proj and down_proj parameters")


class InvariantSharedExpertMoeBlock(PatchedOp):
    """Replaces Qwen2-MoE's `*SparseMoeBlock`: routed experts + sigmoid(gate(x)) * shared_expert(x).

    The same children (router, experts, shared MLP, gate) and the same arithmetic
    as HF's block; only the sigmoid is the invariant op.
    """

    def __init__(self, base: nn.Module, op: Callable, backend: str, device_type: str):
        super().__init__(op, backend, device_type)
        self.gate, self.experts = base.gate, base.experts
        self.shared_expert, self.shared_expert_gate = base.shared_expert, base.shared_expert_gate

    def forward(self, hidden_states):
        check_patched_device(self, hidden_states)
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden = hidden_states.view(-1, hidden_dim)  # (N, H)
        shared = self.shared_expert(hidden)
        _, routing_weights, selected_experts = self.gate(hidden)
        expert_output = self.experts(hidden, selected_experts, routing_weights)
        shared = self.op(self.shared_expert_gate(hidden)) * shared  # (N, 1) * (N, H)
        return (expert_output + shared).reshape(batch_size, sequence_length, hidden_dim)

    def extra_repr(self):
        return f"shared_expert_gate=sigmoid, {self._tags()}"


def moe_replacement(child: nn.Module, family: Family, config, ops: dict, tags: tuple):
    """(kind, invariant module) for an HF router / experts module of `family`, else None."""
    spec = family.moe
    if spec is None:
        return None
    name = type(child).__name__
    if name.endswith(spec.router_class_suffix) and not isinstance(child, PatchedOp):
        renormalize, in_model_dtype = routing_options(spec, config)
        router = InvariantMoeRouter(
            child,
            ops["moe_router"],
            *tags,
            renormalize=renormalize,
            weights_in_model_dtype=in_model_dtype,
        )
        return "moe_router", router
    if name.endswith(spec.experts_class_suffix) and hasattr(child, "gate_up_proj"):
        return "moe_experts", InvariantMoeExperts(child, ops["moe_experts"], *tags)
    return None


def shared_expert_blocks(
    model: nn.Module, family: Family
) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, name, block) of every sparse block with a shared expert, in model order."""
    spec = family.moe
    if spec is None or not spec.shared_expert:
        return []
    return [
        (parent, child_name, child)
        for _, parent in model.named_modules()
        for child_name, child in parent.named_children()
        if type(child).__name__.endswith(spec.block_class_suffix)
    ]


# ----------------------------------------------------------------------------- routing records


def is_router(module: nn.Module) -> bool:
    """An MoE router, HF's or the invariant one (its rows are the call's flattened tokens)."""
    return isinstance(module, InvariantMoeRouter) or type(module).__name__.endswith("TopKRouter")


def is_experts(module: nn.Module) -> bool:
    """An MoE experts module, HF's or the invariant one (flattened tokens in and out)."""
    return isinstance(module, InvariantMoeExperts) or (
        type(module).__name__.endswith("Experts") and hasattr(module, "gate_up_proj")
    )


def moe_layers(model: nn.Module) -> list[str]:
    """Names of the model's router modules (one per sparse block), in model order; [] if dense."""
    return [name for name, module in model.named_modules() if is_router(module)]


def router_settings(model: nn.Module) -> tuple[int, int]:
    """(num_experts, top_k) of the model's routers (they share them); ValueError if dense."""
    routers = [m for m in model.modules() if is_router(m)]
    if not routers:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router")
    return int(routers[0].num_experts), int(routers[0].top_k)


@dataclass
class RouterCall:
    """One forward of one router (rows = the call's flattened tokens)."""

    inputs: torch.Tensor | None
    """(N, H) the hidden states routed (kept only with `inputs=True`)."""
    logits: torch.Tensor
    """(N, E) router logits in the model dtype (on the graph with `detach=False`)."""
    indices: torch.Tensor
    """(N, k) int64 chosen experts, descending probability."""
    experts_out: torch.Tensor | None = None
    """(N, H) the experts module's output for these rows (with `experts=True`)."""


@dataclass
class RoutingRecorder:
    """Records every router call (and optionally the experts' output) while open.

    `calls[layer]` lists the calls of router `layer` (a name of `moe_layers`)
    in order. `detach=False` keeps the logits on the autograd graph (auxiliary
    loss); the diagnostics keep detached copies of inputs and experts outputs.
    Use as a context manager: the hooks are removed on exit, whatever happens.
    """

    model: nn.Module
    detach: bool = True
    inputs: bool = False
    experts: bool = False
    calls: dict[str, list[RouterCall]] = field(default_factory=dict)
    _handles: list = field(default_factory=list, repr=False)

    def __enter__(self) -> RoutingRecorder:
        blocks = {}
        for name, module in self.model.named_modules():
            if is_router(module):
                self.calls[name] = []
                self._handles.append(module.register_forward_hook(self._router_hook(name)))
                blocks[name.rsplit(".", 1)[0]] = name
        if self.experts:
            for name, module in self.model.named_modules():
                router = blocks.get(name.rsplit(".", 1)[0])
                if router is not None and is_experts(module):
                    self._handles.append(module.register_forward_hook(self._experts_hook(router)))
        if not self.calls:
            self.close()
            raise ValueError(f"{type(self.model).__name__} has no mixture-of-experts router")
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _keep(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone() if self.detach else t

    def _router_hook(self, name: str):
        def record(_module, args, output):
            logits, _, indices = output
            hidden = args[0].reshape(-1, args[0].shape[-1]) if self.inputs else None
            self.calls[name].append(
                RouterCall(
                    inputs=None if hidden is None else hidden.detach().clone(),
                    logits=self._keep(logits),
                    indices=indices.detach().clone(),
                )
            )

        return record

    def _experts_hook(self, router: str):
        def record(_module, _args, output):
            self.calls[router][-1].experts_out = output.detach().clone()

        return record
