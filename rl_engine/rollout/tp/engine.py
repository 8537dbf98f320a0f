"""`TensorParallelEngine`: one rollout engine split over the N processes of a process group.

Every rank runs the same `RolloutEngine` loop (scheduler, KV cache of its own
heads, packed or padded prefills) on a model sharded by `shard_model`. One
scheduler decides: rank 0 alone gathers the full row of logits, takes the
log_softmax and samples; it broadcasts each step's tokens and logprobs, and
every rank appends exactly those. Admission, slot release and stop conditions
are a function of that token stream and the (checked identical) request, so
every rank's batches are rank 0's. Which requests share a prompt's prefill is a
function of the same requests and slots, so every rank copies the same slots' rows
(each its own KV heads). Every logit is one full-K chain computed on
one rank and the gathers copy bits: completions and logprobs are those of the
TP = 1 engine, bit for bit.

Use: torch.distributed initialised with one process per rank (gloo on cpu,
NCCL on cuda); each builds the same (patched) model and calls
`TensorParallelEngine(model, device=..., group=...)` and `generate` with the
same prompts and sampling. `rl_engine.rollout.tp.launch` starts such processes
with torch.multiprocessing.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

from rl_engine.rollout.engine import RolloutEngine
from rl_engine.rollout.sampling import SamplingParams
from rl_engine.rollout.stepper import Stepper
from rl_engine.rollout.tp.collectives import ShardGroup
from rl_engine.rollout.tp.load import read_shards
from rl_engine.rollout.tp.shard import (
    shard_model,
    shard_state_dict,
    weight_plan_for,
    weight_targets,
)
from rl_engine.rollout.weight_receiver import WeightReceiver


class TensorParallelEngine(RolloutEngine):
    """A `RolloutEngine` over this rank's shards; call it on every rank of `group` alike.

    model: the full model (patched for bitwise parity), sharded in place here.
    group: the torch.distributed group of the engine's ranks (None: the default group).
    Other arguments as `RolloutEngine`; every rank returns the same completions.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        device: str | torch.device,
        group=None,
        max_batch_size: int = 8,
        max_seq_len: int | None = None,
        weight_version: int = 0,
        progress: bool | None = None,
        share_prompt_prefill: bool = True,
        speculative=None,
        draft_model: nn.Module | None = None,
    ):
        self.shards = ShardGroup(group)
        super().__init__(
            model,
            device=device,
            max_batch_size=max_batch_size,
            max_seq_len=max_seq_len,
            weight_version=weight_version,
            progress=progress if self.shards.rank == 0 else False,
            share_prompt_prefill=share_prompt_prefill,
            speculative=speculative,
            draft_model=draft_model,
        )
        self.layout = shard_model(model, self.shards)

    @property
    def tp_rank(self) -> int:
        return self.shards.rank

    @property
    def tensor_parallel_size(self) -> int:
        return self.shards.world

    def generate(
        self,
        prompts,
        sampling: SamplingParams | None = None,
        *,
        progress=None,
        after_env_turn: bool = False,
    ):
        """As `RolloutEngine.generate`; every rank must pass the same prompts, sampling and
        after_env_turn, and have the same share_prompt_prefill (checked: a ValueError on every
        rank otherwise)."""
        self._check_same_request(prompts, sampling, after_env_turn)
        return super().generate(
            prompts,
            sampling,
            progress=progress if self.tp_rank == 0 else False,
            after_env_turn=after_env_turn,
        )

    def generate_episodes(
        self, starts, sampling, on_turn_end=None, *, max_total_tokens: int, progress=None
    ):
        """As `RolloutEngine.generate_episodes` with each turn's whole transcript as a start
        (`on_turn_end` None); every rank must pass the same starts and sampling (checked). A
        hook is refused: every rank would have to take the same decision after every turn,
        which nothing checks yet."""
        if on_turn_end is not None:
            raise NotImplementedError(
                "a tensor-parallel engine plays one turn per generate_episodes call (no "
                "on_turn_end): its ranks would have to agree on every continuation"
            )
        request = [(list(s.prompt_ids), s.episode, s.turn) for s in starts]
        self._check_same_request(request, (sampling, max_total_tokens), True)
        return super().generate_episodes(
            starts,
            sampling,
            max_total_tokens=max_total_tokens,
            progress=progress if self.tp_rank == 0 else False,
        )

    def load_weights(self, state_dict, version: int) -> None:
        """A full state dict; each rank copies only its rows (no copy of the others)."""
        super().load_weights(shard_state_dict(self.model, state_dict), version)

    def load_shards(self, path, version: int) -> int:
        """Read only this rank's rows from a safetensors file or an HF folder (`read_shards`)
        into the model in place and set `weight_version`; returns the bytes read."""
        state_dict, read = read_shards(self.model, path)
        RolloutEngine.load_weights(self, state_dict, version)  # already this rank's rows
        self.last_load_bytes = read
        return read

    def weight_receiver(self, manifest, plan=None, *, receiver: int = 0, bucket_bytes: int):
        """A receiver of weight syncs that takes only this rank's shards (`weight_plan_for`)."""
        plan = weight_plan_for(self.model, manifest) if plan is None else plan
        targets = weight_targets(self.model)
        return WeightReceiver(targets, manifest, plan, receiver, bucket_bytes)

    def _make_stepper(self, cache, sampling: SamplingParams) -> Stepper:
        return _ShardedStepper(self, cache, sampling)

    def _check_same_request(self, prompts, sampling, after_env_turn: bool) -> None:
        # the sharing flags decide which prompts a prefill forward runs: ranks must agree
        request = (_plain(prompts), sampling, self.share_prompt_prefill, after_env_turn)
        digest = hashlib.blake2b(repr(request).encode(), digest_size=16)
        digests = self.shards.gather_objects(digest.hexdigest())
        if len(set(digests)) != 1:
            raise ValueError(
                "the ranks of a tensor-parallel engine were given different prompts or sampling "
                "(or prefill sharing) "
                f"(request digests by rank: {digests}); every rank must generate the same request"
            )


class _ShardedStepper(Stepper):
    """The forwards of one generate call on one rank: rank 0 scores and samples for all."""

    def __init__(self, engine: TensorParallelEngine, cache, sampling: SamplingParams):
        super().__init__(engine, cache, sampling)
        self.shards = engine.shards
        self.vocab_widths = engine.layout.widths("vocab")

    def _logprobs(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(B, H) -> rank 0: (B, V) fp32 log softmax over the whole vocabulary; others: None."""
        head = self.model.get_output_embeddings()
        if self.engine.batch_invariant:
            local = self._lm_head(hidden, head.weight, head.bias)  # (B, V / N) fp32 logits
        else:
            local = nn.functional.linear(hidden, head.weight, head.bias).float()
        logits = self.shards.gather_last_to_first(local, self.vocab_widths)  # (B, V) on rank 0
        return None if logits is None else self._scaled_log_softmax(logits)

    def share_walk(self, walked, requests: int, width: int):
        """Rank 0's walk of a verifying forward (verify.py) on every rank: tokens (-1 past a
        request's last) and their fp32 logprobs, broadcast as (requests, width) tensors."""
        tokens = torch.full((requests, width), -1, dtype=torch.int64, device=self.device)
        values = torch.zeros((requests, width), dtype=torch.float32, device=self.device)
        if self.shards.rank == 0:
            for row, (chosen, picked) in enumerate(walked):
                tokens[row, : len(chosen)] = torch.tensor(chosen)
                values[row, : len(picked)] = torch.tensor(picked, dtype=torch.float32)
        self.shards.broadcast_from_first(tokens)
        self.shards.broadcast_from_first(values)
        kept = tokens >= 0
        return [
            (tokens[row][kept[row]].tolist(), values[row][kept[row]].tolist())
            for row in range(requests)
        ]

    def _sample(self, requests, logp) -> None:
        tokens = torch.zeros(len(requests), dtype=torch.int64, device=self.device)
        picked = torch.zeros(len(requests), dtype=torch.float32, device=self.device)
        if self.shards.rank == 0:
            chosen, values = self._choose(requests, logp)
            tokens.copy_(torch.tensor(chosen))
            picked.copy_(torch.tensor(values, dtype=torch.float32))  # fp32 values: exact
        self.shards.broadcast_from_first(tokens)
        self.shards.broadcast_from_first(picked)
        self._append(requests, tokens.tolist(), picked.tolist())


def _plain(prompts):
    """Prompts as nested lists (tensors included), for the request digest."""
    if isinstance(prompts, torch.Tensor):
        return prompts.tolist()
    try:
        return [p.tolist() if isinstance(p, torch.Tensor) else list(p) for p in prompts]
    except TypeError:
        return repr(prompts)


def engine_from_folder(spec, *, dtype: torch.dtype, device, patch: bool, group=None, **kwargs):
    """(a TP engine of an HF folder whose rank read only its rows, the tokenizer): the model is
    built from the folder's config, moved, patched (when `patch`), sharded, then
    `load_shards` reads this rank's rows and the replicated tensors (weight_version 0).

    Peak memory at start is still one whole (randomly initialised) model per process,
    until `shard_model` drops the other ranks' rows; the disk reads are this rank's."""
    from rl_engine.models import load_skeleton
    from rl_engine.patching import apply_batch_invariant

    model, tokenizer = load_skeleton(spec, dtype=dtype)
    model.to(device)  # first move, then patch: the ops are resolved for this device
    if patch:
        apply_batch_invariant(model)
    engine = TensorParallelEngine(model, device=device, group=group, **kwargs)
    engine.load_shards(spec, version=0)
    return engine, tokenizer
