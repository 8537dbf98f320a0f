"""What DeepSpeed wraps and steps: the policy, its logprob module and the guard on the optimizer step.

Logprobs never go through full logits: `LogprobModule` (the module handed to
`deepspeed.initialize`) runs the Hugging Face decoder to its final hidden states
and scores them with `rl_engine.logprobs.score_targets` (padded micro-batches) or
`packed_score_targets` (packed rows) on the LM-head weight.
That weight is used outside the LM-head module's own forward, so under ZeRO-3 it
is registered as an external parameter of the wrapper
(`deepspeed.zero.register_external_parameter`): DeepSpeed gathers it for the
wrapper's forward and backward. A weight the head shares with the input embedding gets
its gradient once, at the end of the backward (`tied_gradient`).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from rl_engine.config import RunConfig
from rl_engine.executors.worker.distributed import Collectives
from rl_engine.executors.worker.micro_batches import MicroBatch
from rl_engine.executors.worker.optim.adamw import all_finite
from rl_engine.executors.worker.policy.tied_gradient import tied_head_gradient
from rl_engine.logprobs import IGNORE_INDEX, packed_score_targets, score_targets
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant, lm_head_parameters, patch_handle
from rl_engine.patching.lora import add_lora, base_fingerprint, check_adapter_shape, has_lora


class LogprobModule(nn.Module):
    """HF decoder -> final hidden states -> fused `linear_logp` on the LM-head weight."""

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.policy = policy

    def head_parameters(self) -> tuple[nn.Parameter, nn.Parameter | None]:
        """(weight (V, H), bias (V,) or None) of the policy's vocabulary projection."""
        return lm_head_parameters(self.policy)

    def forward(
        self, input_ids, attention_mask, targets, temperature: float, positions=None, segments=None
    ) -> torch.Tensor:
        """Padded: input_ids/attention_mask (B, T), targets (B, T-1) -> fp32 logprobs (B, T-1).
        Packed (positions and segments given, attention_mask None): input_ids, positions,
        segments, targets (R, N) -> (R, N). 0 at IGNORE_INDEX."""
        with tied_head_gradient(self.policy) as deferred:  # a tied weight's one V x H gradient
            if positions is None:
                return score_targets(
                    self.policy,
                    input_ids,
                    attention_mask,
                    targets,
                    temperature=temperature,
                    deferred_weight_grad=deferred,
                )
            return packed_score_targets(
                self.policy,
                input_ids,
                positions,
                segments,
                targets,
                temperature=temperature,
                deferred_weight_grad=deferred,
            )


def micro_batch_logprobs(module, mb: MicroBatch | None, device: torch.device) -> torch.Tensor:
    """(b, T-1) fp32 logprobs of `mb`'s padded view by `module` (a LogprobModule, or the
    DeepSpeed engine around one) at the batch's own temperature, 0 off the response mask;
    packed micro-batches run packed. None: the empty micro-batch's forward on a two-token
    dummy row ((1, 1) zeros, on the autograd graph)."""
    if mb is None:
        ids = torch.zeros((1, 2), dtype=torch.long, device=device)
        ignore = torch.full((1, 1), IGNORE_INDEX, dtype=torch.long, device=device)
        return module(ids, torch.ones_like(ids), ignore, 1.0)
    b, targets = mb.batch, mb.targets()
    if mb.packed is None:
        return module(b.input_ids, b.attention_mask, targets, b.logprob_temperature)
    p = mb.packed
    logp = module(p.input_ids, None, targets, b.logprob_temperature, p.positions, p.segments)
    return mb.logprobs_view(logp)


class StepGuard:
    """Wraps the torch optimizer's `step` so that an update is applied on all ranks or on none.

    DeepSpeed calls the torch optimizer's step on every rank at the accumulation boundary
    (on the fp32 master partitions under ZeRO), unless it skipped the step itself (ZeRO-3,
    fp32 ZeRO-1/2 and the bf16 optimizer skip on a non-finite gradient norm; plain fp32
    and bf16 ZeRO-1/2 do not). The guard checks this rank's gradients, ORs the flag with
    `force_skip` (set by the worker for a non-finite loss) and all-reduces it: if any rank
    objects, no rank calls the real step, so weights and optimizer state stay untouched.
    `outcome` is 'stepped', 'skipped', or None when DeepSpeed never called the step.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, comm: Collectives):
        self.optimizer, self.comm = optimizer, comm
        self._step = optimizer.step
        optimizer.step = self._guarded_step  # instance attribute: DeepSpeed calls optimizer.step()
        self.force_skip, self.outcome = False, None

    def arm(self, force_skip: bool) -> None:
        self.force_skip, self.outcome = force_skip, None

    @torch.no_grad()
    def _guarded_step(self, *args, **kwargs):
        grads = [
            p.grad
            for group in self.optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        bad = self.force_skip or any(not all_finite(g) for g in grads)
        if self.comm.any(bad):
            self.outcome = "skipped"
            return None
        self.outcome = "stepped"
        return self._step(*args, **kwargs)


def release_zero3_parameters(engine) -> None:
    """After an exception inside a ZeRO-3 forward/backward: release every gathered parameter."""
    coordinator = engine.optimizer.parameter_offload.get_param_coordinator()
    coordinator.release_and_reset_all(engine.module)


def load_policy(config: RunConfig, *, adapter_seed: int | None = None):
    """(model, tokenizer): `load_model(config.model, seed=config.seed)` with the `lora:`
    section's adapter when its rank > 0 (PEFT's, initialised from `adapter_seed`, default
    config.seed: every rank and every engine builds the same one). Unpatched, on the CPU."""
    check_no_diagnostics_adapter(config)
    model, tokenizer = load_model(config.model, dtype=config.torch_dtype, seed=config.seed)
    return with_lora(model, config, seed=adapter_seed), tokenizer


def check_no_diagnostics_adapter(config: RunConfig) -> None:
    """A policy to train never takes the `adapter:` key (diagnostics' adapter folder)."""
    if config.adapter is not None:
        raise ValueError(
            f"adapter: {config.adapter!r} is read by `rl-engine diagnose --config` only; a "
            "trained policy's adapter is the lora: section's, drawn from the run's seed"
        )


def with_lora(model: nn.Module, config: RunConfig, *, seed: int | None = None) -> nn.Module:
    """`model` with the `lora:` section's adapter added (unless it has one already), drawn
    from `seed` (default config.seed); a model with an adapter when lora.rank is 0 raises."""
    lora = config.lora
    if has_lora(model):
        if not lora.enabled:
            raise ValueError("the model carries LoRA adapters but lora.rank is 0")
        check_adapter_shape(model, lora.rank, lora.scale)
        return model
    if not lora.enabled:
        return model
    return add_lora(
        model,
        rank=lora.rank,
        alpha=lora.alpha,
        target_modules=lora.target_modules,
        seed=config.seed if seed is None else seed,
    )


def prepare_policy(
    model: nn.Module | None,
    config: RunConfig,
    device: torch.device,
    *,
    adapter_seed: int | None = None,
) -> nn.Module:
    """The worker's policy on `device`: `model`, else `load_policy(config)`'s; with
    `lora.rank` > 0 it carries the adapter (only its parameters train), drawn from
    `adapter_seed` (default config.seed) when the model has none yet.

    Moved first, then patched when `config.batch_invariant` (patching resolves the ops for
    the device); a model patched for another device, or patched without batch_invariant, raises.
    """
    check_no_diagnostics_adapter(config)
    if model is None:
        model, _ = load_policy(config, adapter_seed=adapter_seed)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch nn.Module, got {type(model).__name__}")
    if patch_handle(model) is None:
        model = with_lora(model, config, seed=adapter_seed)
    elif config.lora.enabled and not has_lora(model):
        raise ValueError(
            "lora.rank > 0 but the model is patched without adapters: pass it unpatched"
        )
    dtypes = sorted({str(p.dtype) for p in model.parameters()})
    if dtypes != [str(config.torch_dtype)]:
        raise ValueError(f"model parameters are {dtypes} but dtype is {config.dtype!r}")
    handle = patch_handle(model)
    if handle is not None and handle.device_type != device.type:
        raise ValueError(
            f"model was patched for {handle.device_type!r} but the worker runs on "
            f"{device}: pass it unpatched (the worker moves it, then patches)"
        )
    model = model.to(device)  # move first: patching resolves the ops for this device
    if config.batch_invariant and handle is None:
        apply_batch_invariant(model)  # before deepspeed.initialize: same Parameter objects
    elif not config.batch_invariant and handle is not None:
        raise ValueError("model is patched (batch-invariant kernels) but batch_invariant is false")
    return model


def checkpoint_activations(model: nn.Module, config: RunConfig) -> None:
    """With `trainer.activation_checkpointing`, each of `model`'s decoder layers recomputes
    its forward in the backward instead of holding its activations (Hugging Face's layer
    checkpointing, torch's non-reentrant checkpoint; only in training mode). Called on the
    trained model before DeepSpeed wraps it, after the frozen KL reference is copied: the
    reference never runs a backward."""
    if config.trainer.activation_checkpointing:
        model.activation_checkpointing_enable(
            activation_checkpointing_kwargs={"use_reentrant": False}
        )


def base_record(policy: nn.Module, config: RunConfig) -> dict | None:
    """A LoRA policy's base as its checkpoints record it ({"model", "hash"}); None without LoRA."""
    if not config.lora.enabled:
        return None
    return {"model": config.model, "hash": base_fingerprint(policy)}


def frozen_copy(policy: nn.Module) -> LogprobModule:
    """The KL reference: a frozen deep copy of the initial policy (same patching), full on every rank."""
    reference = LogprobModule(copy.deepcopy(policy)).eval()
    reference.requires_grad_(False)
    return reference
