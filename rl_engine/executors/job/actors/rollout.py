"""`RolloutActor`: one rollout engine in its own process, or one rank of a tensor-parallel engine.

`start` loads the model (first moved to the actor's device, then patched: the device picks
the kernels), `generate` samples a shard of the step's prompts, `play_episodes` plays a share
of rollout.env's episodes with their environments in this process (`play_turns`: one turn of
whole transcripts, a tensor-parallel engine's episodes), and `weight_plan` /
`connect_weight_group` / `receive_weights` are the engine's side of a weight sync.
"""

from __future__ import annotations

import dataclasses
import time

import ray

from rl_engine.config import RunConfig
from rl_engine.executors.job.actors.process import (
    JobActor,
    actor_device,
    quiet_model_loading,
    release_free_heap,
)
from rl_engine.executors.job.faults import weight_sync_kill_switch


@ray.remote
class RolloutActor(JobActor):
    """One rollout engine in its own process, or one rank of a tensor-parallel engine
    (`rollout.tensor_parallel_size` > 1: its ranks join their own gloo / NCCL group at
    `start`); `start` loads the model."""

    def __init__(
        self, config: RunConfig, index: int = 0, tp_rank: int = 0, env: dict | None = None
    ):
        super().__init__(config, env)
        self.index, self.tp_rank = index, tp_rank
        self.receiver = self.adapter_receiver = self.group = None
        self.episodes = None  # rollout.env's EpisodeRunner, made at the first episodes

    def start(self, tp_address: str | None = None, tp_port: int | None = None) -> dict:
        from rl_engine.executors.worker.policy.setup import load_policy
        from rl_engine.models import has_safetensors
        from rl_engine.patching import apply_batch_invariant
        from rl_engine.rollout import RolloutEngine

        quiet_model_loading()
        config = self.config
        device = actor_device(config)
        engine_args = {  # the engine arguments the run config sets
            "max_batch_size": config.rollout.max_batch_size,
            "share_prompt_prefill": config.rollout.share_prompt_prefill,
            **speculation_args(config, device),
        }
        if config.rollout.tensor_parallel_size > 1:
            self._join_tp_group(device, tp_address, tp_port)
        # a LoRA policy's adapter is not in the base's folder: its ranks load the whole policy
        reads_rows = not config.lora.enabled and has_safetensors(config.model)
        if config.rollout.tensor_parallel_size > 1 and reads_rows:
            from rl_engine.rollout.tp.engine import engine_from_folder

            # this rank reads only its rows of the folder's weights
            self.engine, tokenizer = engine_from_folder(
                config.model,
                dtype=config.torch_dtype,
                device=device,
                patch=config.batch_invariant,
                **engine_args,
            )
            model = self.engine.model
        else:
            # the policy's adapter too (lora.rank > 0), served unmerged (a TP engine splits
            # it: B by output rows, A whole)
            model, tokenizer = load_policy(config)
            model.to(device)  # first move, then patch: the ops are resolved for this device
            if config.batch_invariant:
                apply_batch_invariant(model)
            if config.rollout.tensor_parallel_size > 1:
                from rl_engine.rollout.tp import TensorParallelEngine

                self.engine = TensorParallelEngine(model, device=device, **engine_args)
            else:
                self.engine = RolloutEngine(model, device=device, **engine_args)
        release_free_heap()
        self.tokenizer, self.vocab_size = tokenizer, model.config.vocab_size
        return {
            "vocab_size": model.config.vocab_size,
            "eos_token_id": model.config.eos_token_id,
            "tokenizer": tokenizer,
        }

    def _join_tp_group(self, device: str, address: str, port: int) -> None:
        """The engine's TP ranks' process group: this process's default group."""
        from datetime import timedelta

        import torch.distributed as dist

        dist.init_process_group(
            "nccl" if device.startswith("cuda") else "gloo",
            init_method=f"tcp://{address}:{port}",
            rank=self.tp_rank,
            world_size=self.config.rollout.tensor_parallel_size,
            timeout=timedelta(seconds=self.config.trainer.collective_timeout_s),
        )

    def generate(self, prompts, sampling, after_env_turn: bool = False):
        """(completions, seconds spent generating); after_env_turn: the prompts continue
        transcripts after an environment turn (their prefills never share)."""
        return timed(
            self.engine.generate, prompts, sampling, progress=False, after_env_turn=after_env_turn
        )

    def take_speculation(self) -> dict | None:
        """What speculation did since the last call (SpeculationCounts as a dict; None: off)."""
        counts = getattr(self.engine, "speculation_total", None)
        if counts is None:
            return None
        self.engine.speculation_total = type(counts)()
        return dataclasses.asdict(counts)

    def play_episodes(self, tasks, sampling):
        """(episodes, seconds spent): rollout.env's episodes of `tasks` played on this engine,
        their environments in this process (executors/job/episodes.py)."""
        from rl_engine.executors.job.episodes import EpisodeRunner

        if self.episodes is None:
            self.episodes = EpisodeRunner(self.config, self.tokenizer, self.vocab_size)
        return timed(self.episodes.play, self.engine, tasks, sampling)

    def play_turns(self, starts, sampling, max_total_tokens: int):
        """(completions, seconds spent): one turn of each whole transcript (`TurnStart`s), the
        whole-transcript path of a tensor-parallel engine's episodes."""
        return timed(
            self.engine.generate_episodes,
            starts,
            sampling,
            max_total_tokens=max_total_tokens,
            progress=False,
        )

    def weight_plan(self, manifest, receiver: int):
        """Check the trainer ranks' manifest against this engine's model (ValueError naming the
        key); what this process (receiver `receiver` of the sync) receives of every sync:
        everything, or a TP rank's own shards."""
        bucket = self.config.trainer.weight_sync_bucket_bytes
        self.receiver = self.engine.weight_receiver(
            manifest, receiver=receiver, bucket_bytes=bucket
        )
        if self.config.lora.enabled:  # later syncs: only the adapters (the base is frozen)
            self.adapter_receiver = adapter_receiver(
                self.engine.model, manifest, self.receiver.plan, receiver, bucket
            )
        return self.receiver.plan

    def connect_weight_group(self, address: str, port: int, rank: int, size: int) -> None:
        from rl_engine.executors.worker.weights.weight_transport import WeightGroup

        if self.group is not None:
            self.group.close()
        timeout = self.config.trainer.collective_timeout_s
        self.group = WeightGroup.connect(
            address, port, rank, size, self.engine.device.type, timeout
        )

    def receive_weights(self, adapters_only: bool = False) -> int:
        """One weight sync from the trainer ranks, in place; returns the version now served.
        `adapters_only`: a LoRA policy's adapters alone (the engine holds the frozen base)."""
        hook = weight_sync_kill_switch(f"rollout engine {self.index}")
        receiver = self.adapter_receiver if adapters_only else self.receiver
        return self.engine.receive_weights(receiver, self.group, on_bucket=hook)

    def release_weights(self) -> int:
        """Release the weights a full sync rewrites until that sync (the engine refuses to
        generate until then); returns the bytes released."""
        released = self.engine.release_weights(self.receiver)
        release_free_heap()
        return released


def speculation_args(config: RunConfig, device: str) -> dict:
    """The engine's speculative arguments of rollout.speculative: its params and, for
    draft_model, the draft (loaded in the policy's dtype, moved, then patched)."""
    params = config.rollout.speculative_params
    if params is None:
        return {}
    if params.method != "draft_model":
        return {"speculative": params}
    from rl_engine.models import load_model
    from rl_engine.patching import apply_batch_invariant

    draft, _ = load_model(params.model, dtype=config.torch_dtype)
    draft.to(device)
    apply_batch_invariant(draft)
    return {"speculative": params, "draft_model": draft}


def adapter_receiver(model, manifest, plan, receiver: int, bucket_bytes: int):
    """A receiver of the adapters alone, into the engine model's own adapter tensors."""
    from rl_engine.executors.worker.weights.weight_transport import adapter_names
    from rl_engine.rollout.weight_receiver import WeightReceiver

    names = adapter_names(manifest)
    targets = {n: t for n, t in model.state_dict(keep_vars=True).items() if n in set(names)}
    return WeightReceiver(targets, manifest, plan.only(names), receiver, bucket_bytes)


def timed(run, *args, **kwargs):
    """(run's result, its seconds); the heap it freed goes back to the OS after."""
    started = time.perf_counter()
    result = run(*args, **kwargs)
    seconds = time.perf_counter() - started
    release_free_heap()
    return result, seconds
