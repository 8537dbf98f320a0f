"""`DeepSpeedTrainingWorker`: one DeepSpeed data-parallel rank of the RL trainer.

Per step the worker scores its shard of completions with a teacher-forced
forward through the batch-invariant kernels, checks those logprobs against the
rollout engine's, token by token, *before* the update (parity), and takes a
GRPO/PPO clipped-surrogate step with DeepSpeed (ZeRO 0-3, fp32 or bf16,
gradient accumulation, gradient clipping).

Logprobs never go through full logits: the module handed to
`deepspeed.initialize` (`LogprobModule`) runs the Hugging Face decoder to its
final hidden states and scores them with the patched model's `linear_logp` on the
LM-head weight. That weight is used outside the LM-head module's own forward,
so under ZeRO-3 it is registered as an external parameter of the wrapper
(`deepspeed.zero.register_external_parameter`): DeepSpeed gathers it for the
wrapper's forward and backward.

Distributed setup comes from RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR /
MASTER_PORT (single-process defaults when unset): gloo and DeepSpeed's CPU
accelerator on CPU, nccl on CUDA. deepspeed is imported lazily, after the
accelerator is chosen.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from rl_engine.algorithms import kl_k3, policy_loss, truncated_importance_weights
from rl_engine.config import RunConfig
from rl_engine.diagnostics.metrics import first_mismatch
from rl_engine.executors.batch import TrainBatch
from rl_engine.io import write_text_atomic
from rl_engine.logprobs import IGNORE_INDEX, final_hidden_states
from rl_engine.models import load_model
from rl_engine.patching import apply_batch_invariant, lm_head_parameters, model_op

logger = logging.getLogger(__name__)


class ParityError(RuntimeError):
    """The trainer's logprobs differ from the rollout's (parity: strict); raised before the update."""

    def __init__(
        self,
        message: str,
        *,
        rank: int | None = None,
        sequence: int | None = None,
        position: int | None = None,
        trainer_logprob: float | None = None,
        rollout_logprob: float | None = None,
    ):  # defaults: unpickling (Ray) passes only the message
        super().__init__(message)
        self.rank, self.sequence, self.position = rank, sequence, position
        self.trainer_logprob, self.rollout_logprob = trainer_logprob, rollout_logprob


# ---------------------------------------------------------------------------- distributed setup


@dataclass(frozen=True, slots=True)
class DistEnv:
    """This process's place in the job, from the torch.distributed environment variables."""

    rank: int
    world_size: int
    local_rank: int

    @classmethod
    def from_environ(cls) -> DistEnv:
        """Read (and for a single process, default) RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT."""
        values = {}
        defaults = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": os.environ.get("RANK", "0")}
        for key, default in defaults.items():
            raw = os.environ.get(key, default)
            if not raw.isdigit():
                raise ValueError(
                    f"environment variable {key} must be a non-negative int, got {raw!r}"
                )
            values[key] = int(raw)
        if values["WORLD_SIZE"] < 1 or values["RANK"] >= values["WORLD_SIZE"]:
            raise ValueError(
                f"RANK={values['RANK']} must be < WORLD_SIZE={values['WORLD_SIZE']} (>= 1)"
            )
        if values["WORLD_SIZE"] > 1 and not {"MASTER_ADDR", "MASTER_PORT"} <= os.environ.keys():
            raise ValueError("WORLD_SIZE > 1 needs MASTER_ADDR and MASTER_PORT in the environment")
        os.environ.update(
            RANK=str(values["RANK"]),
            WORLD_SIZE=str(values["WORLD_SIZE"]),
            LOCAL_RANK=str(values["LOCAL_RANK"]),
        )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
        return cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _check_device(device, local_rank: int) -> torch.device:
    """cpu, or cuda:<index> (a bare 'cuda' means this process's LOCAL_RANK)."""
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device must be a str or torch.device, got {type(device).__name__}")
    device = torch.device(device)
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"unsupported device {device}; the worker runs on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device} requested but CUDA is not available in this process")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", local_rank)
    return device


def _import_deepspeed(device: torch.device):
    """Import deepspeed with the accelerator matching `device`; return (deepspeed, backend name)."""
    wanted = "cpu" if device.type == "cpu" else "cuda"
    chosen = os.environ.setdefault("DS_ACCELERATOR", wanted)
    if chosen != wanted:
        raise ValueError(
            f"device {device} needs DS_ACCELERATOR={wanted}, but DS_ACCELERATOR={chosen}"
        )
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() != wanted:
        raise ValueError(
            f"DeepSpeed already chose the {get_accelerator().device_name()!r} accelerator in this process; "
            f"device {device} needs {wanted!r}"
        )
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return deepspeed, ("gloo" if device.type == "cpu" else "nccl")


# ---------------------------------------------------------------------------- DeepSpeed config


def load_deepspeed_config(spec: dict | str) -> dict:
    """A deep copy of the user's DeepSpeed config (a dict, or a path to a JSON file)."""
    if isinstance(spec, dict):
        return copy.deepcopy(spec)
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"trainer.deepspeed: DeepSpeed config file {str(path)!r} does not exist")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise ValueError(f"trainer.deepspeed: {str(path)!r} is not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ValueError(f"trainer.deepspeed: {str(path)!r} must hold a JSON object")
    return data


def build_deepspeed_config(config: RunConfig, world_size: int) -> dict:
    """The DeepSpeed config for `config`: the user's, with batch sizes, clipping and bf16 filled in.

    Raises ValueError naming the key for anything DeepSpeed would reject or that
    contradicts the run config; a key present in both must agree.
    """
    if world_size != config.trainer.num_ranks:
        raise ValueError(
            f"trainer.num_ranks={config.trainer.num_ranks} but WORLD_SIZE={world_size}"
        )
    ds = load_deepspeed_config(config.trainer.deepspeed)
    _reject_unsupported(ds)
    _set_bf16(ds, config.dtype)
    micro, accum = config.trainer.micro_batch_size, config.gradient_accumulation_steps
    _fill(ds, "train_micro_batch_size_per_gpu", micro, "trainer.micro_batch_size")
    _fill(
        ds,
        "gradient_accumulation_steps",
        accum,
        "sequences_per_step / (micro_batch_size x num_ranks)",
    )
    _fill(
        ds,
        "train_batch_size",
        micro * accum * world_size,
        "rollout.prompts_per_step x samples_per_prompt",
    )
    _fill(ds, "gradient_clipping", float(config.trainer.grad_clip), "trainer.grad_clip")
    zero = ds.setdefault("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ValueError(f"deepspeed.zero_optimization must be an object, got {zero!r}")
    if config.trainer.zero_stage is not None:
        zero["stage"] = config.trainer.zero_stage
    zero.setdefault("stage", 0)
    return ds


def _reject_unsupported(ds: dict, prefix: str = "deepspeed.") -> None:
    for key, value in ds.items():
        if value == "auto":
            raise ValueError(
                f"{prefix}{key} is 'auto': give a value (the worker fills batch sizes, clipping, bf16)"
            )
        if isinstance(value, dict):
            _reject_unsupported(value, f"{prefix}{key}.")
    if prefix != "deepspeed.":
        return
    for key in ("optimizer", "scheduler"):
        if key in ds:
            raise ValueError(
                f"deepspeed.{key} is not supported: the worker builds torch AdamW from trainer.lr / "
                "trainer.weight_decay; remove the key"
            )
    if _section(ds, "fp16").get("enabled", False):
        raise ValueError(
            "deepspeed.fp16.enabled: fp16 is not supported; use dtype: bfloat16 (or float32)"
        )


def _section(ds: dict, name: str) -> dict:
    value = ds.get(name, {})
    if not isinstance(value, dict):
        raise ValueError(f"deepspeed.{name} must be an object, got {value!r}")
    return value


def _set_bf16(ds: dict, dtype: str) -> None:
    want = dtype == "bfloat16"
    key = "bfloat16" if "bfloat16" in ds else "bf16"  # DeepSpeed accepts the old name too
    section = _section(ds, key)
    enabled = section.get("enabled", want)
    if not isinstance(enabled, bool):
        raise ValueError(f"deepspeed.{key}.enabled must be true or false, got {enabled!r}")
    if enabled != want:
        raise ValueError(
            f"deepspeed.{key}.enabled is {enabled} but dtype is {dtype!r}: they must agree "
            f"(bf16 on exactly when dtype is 'bfloat16')"
        )
    ds[key] = {**section, "enabled": want}


def _fill(ds: dict, key: str, value, source: str) -> None:
    if key not in ds:
        ds[key] = value
        return
    given = ds[key]
    numeric = isinstance(given, (int, float)) and not isinstance(given, bool)
    if not numeric or given != value:
        raise ValueError(
            f"deepspeed.{key} = {given!r} contradicts the run config ({source} gives {value!r}); "
            "remove the key or make them agree"
        )


def _validate_with_deepspeed(ds: dict) -> None:
    """Let DeepSpeed parse the config now, so a rejection is a ValueError before any engine exists."""
    from deepspeed.runtime.config import DeepSpeedConfig
    from pydantic import ValidationError

    try:
        DeepSpeedConfig(copy.deepcopy(ds))
    except ValidationError as err:
        problems = "; ".join(
            f"{_dotted_key(ds, e['loc'])}: {e['msg']} (got {e.get('input')!r})"
            for e in err.errors()
        )
        raise ValueError(f"DeepSpeed rejected the config: {problems}") from None
    except (
        AssertionError,
        ValueError,
        TypeError,
        KeyError,
    ) as err:  # DeepSpeed checks batch sizes with assert
        raise ValueError(f"DeepSpeed rejected the config: {err}") from err


def _dotted_key(ds: dict, loc: tuple) -> str:
    """'deepspeed.<section>.<key>' for a pydantic error location inside one of the config's sections."""
    key = ".".join(str(part) for part in loc)
    sections = [
        name for name, value in ds.items() if isinstance(value, dict) and loc and loc[0] in value
    ]
    return f"deepspeed.{sections[0]}.{key}" if sections else f"deepspeed.{key}"


# ---------------------------------------------------------------------------- the module DeepSpeed wraps


class LogprobModule(nn.Module):
    """HF decoder -> final hidden states -> fused `linear_logp` on the LM-head weight."""

    def __init__(self, policy: nn.Module, device: torch.device):
        super().__init__()
        self.policy = policy
        self._linear_logp = model_op(policy, "linear_logp")  # the patched backend's op

    def head_parameters(self) -> tuple[nn.Parameter, nn.Parameter | None]:
        """(weight (V, H), bias (V,) or None) of the policy's vocabulary projection."""
        return lm_head_parameters(self.policy)

    def forward(self, input_ids, attention_mask, targets, temperature: float) -> torch.Tensor:
        """input_ids/attention_mask (B, T), targets (B, T-1) -> fp32 logprobs (B, T-1), 0 at IGNORE_INDEX."""
        hidden = final_hidden_states(self.policy, input_ids, attention_mask)  # (B, T, H)
        weight, bias = self.head_parameters()  # (V, H), (V,) | None
        return self._linear_logp(
            hidden[:, :-1],
            weight,
            targets,
            bias,
            temperature=temperature,
            ignore_index=IGNORE_INDEX,
        )


def _targets(batch: TrainBatch) -> torch.Tensor:
    """(B, T-1): token t+1 where position t scores a completion token, IGNORE_INDEX elsewhere."""
    return torch.where(
        batch.response_mask,
        batch.input_ids[:, 1:],
        torch.full_like(batch.input_ids[:, 1:], IGNORE_INDEX),
    )


# ---------------------------------------------------------------------------- parity


def parity_sums(trainer: torch.Tensor, rollout: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """(5,) fp64 [exact matches, tokens, sum |diff|, max |diff|, sum k3] over the masked tokens."""
    diff = (trainer.float() - rollout.float()).abs()
    exact = (trainer == rollout) & mask
    k3 = kl_k3(rollout, trainer, mask=mask)  # KL(rollout || trainer), samples from the rollout
    return torch.stack(
        [exact.sum(), mask.sum(), diff[mask].sum(), diff[mask].max(), k3.sum()]
    ).double()


def parity_metrics(sums: torch.Tensor) -> dict[str, float]:
    exact, tokens, abs_sum, abs_max, k3_sum = sums.tolist()
    count = max(tokens, 1.0)
    return {
        "parity/exact_match_fraction": exact / count,
        "parity/max_abs_diff": abs_max,
        "parity/mean_abs_diff": abs_sum / count,
        "parity/kl": k3_sum / count,
        "parity/num_tokens": int(tokens),
    }


# ---------------------------------------------------------------------------- the worker


class DeepSpeedTrainingWorker:
    """One DeepSpeed rank: teacher-forced logprobs, parity check, GRPO/PPO step, weight export, checkpoints.

    Every rank builds the same initial policy (`load_model(config.model, seed=config.seed)`),
    patched when `config.batch_invariant`. `train_step` takes this rank's shard of the
    step's batch (`TrainBatch.shard(rank, world_size)`), with exactly
    `gradient_accumulation_steps x micro_batch_size` sequences.
    """

    def __init__(self, config: RunConfig, *, device: str | torch.device):
        if not isinstance(config, RunConfig):
            raise TypeError(f"config must be a RunConfig, got {type(config).__name__}")
        self.config = config
        self.env = DistEnv.from_environ()
        self.device = _check_device(device, self.env.local_rank)
        ds_config = build_deepspeed_config(config, self.env.world_size)
        self._deepspeed, backend = _import_deepspeed(self.device)
        self._deepspeed.init_distributed(dist_backend=backend)
        _validate_with_deepspeed(ds_config)
        self.ds_config = ds_config
        self.module = self._build_module()
        self.vocab_size = int(
            self.module.head_parameters()[0].shape[0]
        )  # before ZeRO-3 partitions it
        if self.zero_stage == 3:
            self._register_lm_head_with_zero3()
        optimizer = torch.optim.AdamW(
            self.module.parameters(), lr=config.trainer.lr, weight_decay=config.trainer.weight_decay
        )
        self.engine, self.optimizer, _, _ = self._deepspeed.initialize(
            model=self.module, optimizer=optimizer, config=ds_config, dist_init_required=False
        )
        self.reference = self._build_reference() if config.algorithm.kl_coef > 0 else None
        self._aborted = False
        self._log(
            f"DeepSpeed worker ready: {self.env.world_size} rank(s), ZeRO-{self.zero_stage}, {config.dtype}, "
            f"batch_invariant={config.batch_invariant}, parity={config.parity}, device={self.device}"
        )

    # -------------------------------------------------------------- properties

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def zero_stage(self) -> int:
        return int(self.ds_config["zero_optimization"]["stage"])

    @property
    def global_step(self) -> int:
        """Optimizer steps taken (restored by `load_checkpoint`)."""
        return int(self.engine.global_steps)

    # -------------------------------------------------------------- construction

    def _load_policy(self) -> nn.Module:
        policy, _ = load_model(
            self.config.model, dtype=self.config.torch_dtype, seed=self.config.seed
        )
        policy = policy.to(self.device)  # move first: patching resolves ops for this device
        if self.config.batch_invariant:
            apply_batch_invariant(policy)  # before deepspeed.initialize: same Parameter objects
        return policy

    def _build_module(self) -> LogprobModule:
        return LogprobModule(self._load_policy(), self.device)

    def _build_reference(self) -> LogprobModule:
        """A frozen copy of the initial policy (for the KL term), patched the same way; full on every rank."""
        reference = LogprobModule(self._load_policy(), self.device).eval()
        reference.requires_grad_(False)
        return reference

    def _register_lm_head_with_zero3(self) -> None:
        """The LM-head weight (and bias) is used in the wrapper's forward, outside its module's own forward."""
        for param in self.module.head_parameters():
            if param is not None:
                self._deepspeed.zero.register_external_parameter(self.module, param)

    # -------------------------------------------------------------- logprobs

    @torch.no_grad()
    def compute_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """fp32 (B, T-1) logprobs of the current policy at the scored (response_mask) positions, 0 elsewhere.

        Runs in micro-batches through the DeepSpeed engine; under ZeRO-3 that is collective
        (every rank calls it with the same number of micro-batches).
        """
        batch = self._agreed(lambda: self._checked(batch))
        self.engine.eval()
        out = [
            self._forward(mb) for mb in batch.micro_batches(self.config.trainer.micro_batch_size)
        ]
        return torch.cat(out).cpu()

    def _forward(self, mb: TrainBatch, module=None) -> torch.Tensor:
        module = self.engine if module is None else module
        return module(
            mb.input_ids, mb.attention_mask, _targets(mb), self.config.rollout.temperature
        )

    def _checked(self, batch: TrainBatch) -> TrainBatch:
        if not isinstance(batch, TrainBatch):
            raise TypeError(f"batch must be a TrainBatch, got {type(batch).__name__}")
        batch.validate(self.vocab_size)
        return batch.to(self.device)

    def _checked_for_step(self, batch: TrainBatch) -> list[TrainBatch]:
        """This rank's micro-batches: exactly gradient_accumulation_steps of them, each scoring a token."""
        batch = self._checked(batch)
        accum, size = self.config.gradient_accumulation_steps, self.config.trainer.micro_batch_size
        if batch.num_sequences != accum * size:
            raise ValueError(
                f"this rank's shard has {batch.num_sequences} sequences; a step takes exactly "
                f"gradient_accumulation_steps x micro_batch_size = {accum} x {size} per rank"
            )
        micro = batch.micro_batches(size)
        for index, mb in enumerate(micro):
            if not bool(mb.response_mask.any()):
                raise ValueError(
                    f"micro-batch {index} (sequences {index * size}..{(index + 1) * size - 1}) "
                    "scores no completion token"
                )
        return micro

    def _agreed(self, check):
        """Run `check()` on every rank; if it raises on any rank, raise on all (no rank waits in a collective)."""
        error, result = None, None
        try:
            result = check()
        except (ValueError, TypeError) as err:
            error = err
        failed = int(self._all_reduce(torch.tensor([0.0 if error is None else 1.0]), "sum"))
        if error is not None:
            raise error
        if failed:
            raise ValueError(
                f"{failed} other rank(s) rejected their batch (rank {self.rank}'s is valid); "
                "see their errors"
            )
        return result

    # -------------------------------------------------------------- training

    def train_step(self, batch: TrainBatch) -> dict[str, float]:
        """One optimizer step on this rank's shard; returns metrics all-reduced over ranks.

        Metrics: loss (policy loss + kl_coef x kl), policy_loss, clip_fraction, kl (k3 to the
        reference policy, 0 without one), entropy (an ESTIMATE: minus the mean logprob of the
        sampled completion tokens, not the full-distribution entropy), grad_norm, lr, tokens,
        and parity/{exact_match_fraction, max_abs_diff, mean_abs_diff, kl, num_tokens}: the
        trainer's logprobs of this step's first forward vs the rollout's, before the update.

        parity 'strict': each micro-batch is checked right after its forward, before its
        backward, and a mismatch on any rank raises ParityError on every rank; no optimizer
        step is taken. If the mismatch is in micro-batch 0 the worker stays usable; in a later
        one, earlier micro-batches have already accumulated gradients inside DeepSpeed, so the
        worker refuses further steps (strict mode is meant to stop the run).
        """
        if self._aborted:
            raise RuntimeError(
                "an earlier train_step was aborted by a ParityError after gradients were "
                "accumulated; build a new worker (and load_checkpoint) to continue"
            )
        micro = self._agreed(lambda: self._checked_for_step(batch))
        units = self._all_reduce(
            sum(self._aggregation_units(mb) for mb in micro), "sum"
        )  # global normalisers
        self.engine.train()
        sums, parity, norm = (
            torch.zeros(6, dtype=torch.float64),
            torch.zeros(5, dtype=torch.float64),
            None,
        )
        for index, mb in enumerate(micro):
            logp = self._forward(mb)  # (b, T-1) fp32, the step's first forward of these tokens
            parity = _merge_parity(parity, self._check_parity(mb, logp.detach(), index))
            loss, stats = self._micro_loss(mb, logp, units)
            self.engine.backward(loss)
            if index == len(micro) - 1:
                norm = self._stage0_grad_norm()  # before step() clips and clears the gradients
            self.engine.step()  # DeepSpeed updates only at the accumulation boundary (the last one)
            sums += stats
        return self._finish_step(sums, parity, units, norm)

    def _aggregation_units(self, batch: TrainBatch) -> torch.Tensor:
        """Normalisers of every aggregation on this shard: [tokens, non-empty sequences, sequences]."""
        per_seq = batch.response_mask.sum(dim=1)
        return torch.tensor(
            [float(per_seq.sum()), float((per_seq > 0).sum()), float(batch.num_sequences)],
            dtype=torch.float64,
        )

    def _micro_units(self, mb: TrainBatch, units: torch.Tensor) -> float:
        """This micro-batch's share of the global normaliser of the configured aggregation."""
        index = {"token-mean": 0, "seq-mean-token-mean": 1, "seq-mean-token-sum": 2}[
            self.config.algorithm.loss_aggregation
        ]
        return float(self._aggregation_units(mb)[index] / units[index])

    def _micro_loss(self, mb: TrainBatch, logp: torch.Tensor, units: torch.Tensor):
        """Loss of one micro-batch, scaled so DeepSpeed's 1/GA and rank averaging give the global mean.

        Returns (loss tensor, stats (6,) fp64: [loss, policy_loss, clipped tokens, kl, -sum logp, tokens]).
        """
        algo, mask = self.config.algorithm, mb.response_mask
        is_weights = None
        if algo.tis_cap is not None:
            is_weights = truncated_importance_weights(
                logp.detach(), mb.rollout_logprobs, mask, cap=algo.tis_cap
            )
        pg, stats = policy_loss(
            logp,
            mb.rollout_logprobs,
            mb.advantages,
            mask,
            clip_eps=algo.clip_eps,
            clip_eps_high=algo.clip_eps_high,
            aggregation=algo.loss_aggregation,
            is_weights=is_weights,
        )
        kl = self._reference_kl(mb, logp) if self.reference is not None else logp.new_zeros(())
        share = self._micro_units(mb, units)
        loss = (pg + algo.kl_coef * kl) * share
        tokens = mask.sum()
        record = (
            torch.stack(
                [
                    loss.detach(),
                    pg.detach() * share,
                    stats["clip_fraction"] * tokens,
                    kl.detach() * share,
                    -logp.detach()[mask].sum(),
                    tokens.float(),
                ]
            )
            .double()
            .cpu()
        )
        return loss * (self.config.gradient_accumulation_steps * self.world_size), record

    def _reference_kl(self, mb: TrainBatch, logp: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            ref = self._forward(mb, self.reference)  # (b, T-1)
        per_token = kl_k3(logp, ref, mask=mb.response_mask)
        return _aggregate(per_token, mb.response_mask, self.config.algorithm.loss_aggregation)

    def _stage0_grad_norm(self) -> float | None:
        """Plain ZeRO-0 fp32 keeps the averaged grads in .grad and DeepSpeed does not report their norm."""
        if (
            self.zero_stage != 0
            or self.config.dtype != "float32"
            or not self.engine.is_gradient_accumulation_boundary()
        ):
            return None
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        return float(
            torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.double()) for g in grads])
            )
        )

    def _finish_step(self, sums, parity, units, stage0_norm: float | None) -> dict[str, float]:
        sums = self._all_reduce(sums, "sum")
        parity = _reduce_parity(parity, self._all_reduce)
        tokens = max(float(units[0]), 1.0)
        norm = self.engine.get_global_grad_norm()
        norm = stage0_norm if norm is None else norm
        metrics = {
            "loss": float(sums[0]),
            "policy_loss": float(sums[1]),
            "clip_fraction": float(sums[2]) / tokens,
            "kl": float(sums[3]),
            "entropy": float(sums[4]) / tokens,
            "tokens": int(units[0]),
            "grad_norm": float("nan") if norm is None else float(norm),
            "lr": float(self.engine.get_lr()[0]),
            "step": self.global_step,
        }
        if self.config.parity != "off":
            metrics.update(parity_metrics(parity))
        self._log_step(metrics)
        return metrics

    # -------------------------------------------------------------- parity

    def _check_parity(self, mb: TrainBatch, logp: torch.Tensor, index: int) -> torch.Tensor:
        """Parity sums of one micro-batch; under parity 'strict' every rank raises on any mismatch."""
        if self.config.parity == "off":
            return torch.zeros(5, dtype=torch.float64)
        sums = parity_sums(logp, mb.rollout_logprobs, mb.response_mask).cpu()
        if self.config.parity == "strict":
            mismatches = self._all_reduce(sums[1:2] - sums[0:1], "sum")
            if float(mismatches) > 0:
                self._raise_parity(mb, logp, index, int(mismatches))
        return sums

    def _raise_parity(self, mb: TrainBatch, logp: torch.Tensor, index: int, count: int) -> None:
        found = first_mismatch(logp, mb.rollout_logprobs, mb.response_mask)
        self._aborted = index > 0  # earlier micro-batches already accumulated gradients
        offset = index * self.config.trainer.micro_batch_size
        if found is None:
            raise ParityError(
                f"parity: {count} mismatching token(s) on other ranks (none on rank {self.rank})",
                rank=self.rank,
                sequence=None,
                position=None,
                trainer_logprob=None,
                rollout_logprob=None,
            )
        seq, pos, mine, theirs = found
        prompt_len = int(
            mb.response_mask[seq].nonzero()[0]
        )  # first scored position = prompt length - 1
        raise ParityError(
            f"parity: trainer logprob != rollout logprob at rank {self.rank}, sequence {offset + seq} of the shard, "
            f"completion token {pos - prompt_len} (position {pos} scores token {pos + 1}): trainer {mine!r} vs "
            f"rollout {theirs!r} (diff {mine - theirs:.3e}); {count} mismatching token(s) in this micro-batch over "
            f"all ranks; no optimizer step was taken",
            rank=self.rank,
            sequence=offset + seq,
            position=pos,
            trainer_logprob=mine,
            rollout_logprob=theirs,
        )

    # -------------------------------------------------------------- weights and checkpoints

    def export_weights(self) -> dict[str, torch.Tensor] | None:
        """The policy's full state dict under the HF model's own names (what RolloutEngine.load_weights takes).

        Collective under ZeRO-3 (every rank must call it); rank 0 gets the dict, others None.
        Tensors are CPU copies in the trained dtype; tied names share one tensor.
        """
        policy = self.module.policy
        if self.zero_stage == 3:
            with self._deepspeed.zero.GatheredParameters(
                list(policy.parameters()), modifier_rank=None
            ):
                return _cpu_state_dict(policy) if self.rank == 0 else None
        return _cpu_state_dict(policy)

    def save_checkpoint(self, directory: str | Path, tag: str | None = None) -> None:
        """DeepSpeed engine checkpoint (model, optimizer, step) under `directory`; collective.

        Atomic: every rank writes into a temporary tag folder; once all are done, rank 0
        renames it to `tag` and then points `latest` at it (itself an atomic write). An
        interrupted save leaves the previous checkpoint and `latest` untouched.
        """
        directory = Path(directory)
        tag = tag or f"step{self.global_step}"
        staging = f".{tag}.tmp"
        self.engine.save_checkpoint(
            str(directory),
            tag=staging,
            client_state={"rl_engine_step": self.global_step},
            save_latest=False,
        )
        self._barrier()
        if self.rank == 0:
            final = directory / tag
            if final.exists():
                shutil.rmtree(final)
            os.replace(directory / staging, final)
            write_text_atomic(directory / "latest", tag)
        self._barrier()
        self._log(f"saved checkpoint {tag} to {directory}")

    def load_checkpoint(self, directory: str | Path, tag: str | None = None) -> None:
        """Restore model, optimizer and step from `save_checkpoint` (latest tag by default); collective."""
        if not Path(directory).is_dir():
            raise ValueError(f"checkpoint directory {str(directory)!r} does not exist")
        path, _ = self.engine.load_checkpoint(str(directory), tag=tag)
        if path is None:
            raise ValueError(f"no DeepSpeed checkpoint found in {str(directory)!r} (tag {tag!r})")
        self._log(f"loaded checkpoint {path} (step {self.global_step})")

    # -------------------------------------------------------------- helpers

    def _barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()

    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        out = tensor.to(self.device, copy=True)
        dist.all_reduce(out, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
        return out.cpu()

    def _log(self, message: str) -> None:
        if self.rank == 0:
            logger.info(message)

    def _log_step(self, m: dict) -> None:
        parity = (
            f" | parity exact {m['parity/exact_match_fraction']:.4f} max|d| {m['parity/max_abs_diff']:.2e}"
            if "parity/num_tokens" in m
            else ""
        )
        self._log(
            f"step {m['step']}: loss {m['loss']:+.5f} pg {m['policy_loss']:+.5f} kl {m['kl']:.2e} "
            f"clip {m['clip_fraction']:.3f} grad_norm {m['grad_norm']:.3e} tokens {m['tokens']}{parity}"
        )


def _merge_parity(total: torch.Tensor, part: torch.Tensor) -> torch.Tensor:
    merged = total + part
    merged[3] = torch.maximum(total[3], part[3])
    return merged


def _reduce_parity(parity: torch.Tensor, all_reduce) -> torch.Tensor:
    summed = all_reduce(parity, "sum")
    summed[3] = all_reduce(parity[3:4], "max")[0]
    return summed


def _aggregate(per_token: torch.Tensor, mask: torch.Tensor, aggregation: str) -> torch.Tensor:
    """Reduce (b, T-1) per-token values like `policy_loss` does for `aggregation`."""
    keep = mask.bool()
    masked = torch.where(keep, per_token, 0.0)
    counts = keep.sum(dim=1)
    if aggregation == "token-mean":
        return masked.sum() / counts.sum().clamp(min=1)
    if aggregation == "seq-mean-token-sum":
        return masked.sum(dim=1).mean()
    nonempty = counts > 0
    return (masked.sum(dim=1)[nonempty] / counts[nonempty]).mean()


def _cpu_state_dict(policy: nn.Module) -> dict[str, torch.Tensor]:
    out, copies = {}, {}
    for name, tensor in policy.state_dict(keep_vars=True).items():
        key = id(tensor)
        if key not in copies:
            copies[key] = tensor.detach().to("cpu", copy=True)
        out[name] = copies[key]
    return out
