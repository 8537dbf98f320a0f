"""`VllmRolloutActor`: one rollout engine that runs vLLM, exact (`rollout.engine: vllm`).

The same calls as `RolloutActor` (start, generate, the engine's side of a weight sync), served
by `VllmEngine` (rollout/vllm/engine.py): vLLM's CPU build running the trainer's patched model
with rl_engine's sampler. The weight sync goes from the DeepSpeed ranks straight into vLLM's
worker: `collective_rpc` makes the worker (vllm_worker.py) check the manifest, join the
job's weight group and receive every bucket into the served parameters in place.
"""

from __future__ import annotations

import ray

from rl_engine.config import RunConfig
from rl_engine.executors.job.actors.process import JobActor, quiet_model_loading
from rl_engine.executors.job.actors.rollout import timed

WORKER_EXTENSION = "rl_engine.executors.job.actors.vllm_worker.ExactWorkerExtension"


@ray.remote
class VllmRolloutActor(JobActor):
    """One vLLM engine in its own process (rollout.tensor_parallel_size 1, no LoRA, no
    rollout.env: config checks refuse the rest). `env` carries vLLM's settings
    (rollout/vllm/engine.py: ENGINE_ENV), set before vLLM is imported."""

    def __init__(
        self, config: RunConfig, index: int = 0, tp_rank: int = 0, env: dict | None = None
    ):
        super().__init__(config, env)
        self.index = index
        self.engine = None

    def start(self, tp_address: str | None = None, tp_port: int | None = None) -> dict:
        import tempfile
        from pathlib import Path

        from rl_engine.executors.worker.policy.setup import load_policy
        from rl_engine.rollout.vllm.engine import VllmEngine
        from rl_engine.rollout.vllm.folders import write_vllm_folder

        quiet_model_loading()
        config = self.config
        model, tokenizer = load_policy(config)
        info = {
            "vocab_size": model.config.vocab_size,
            "eos_token_id": model.config.eos_token_id,
            "tokenizer": tokenizer,
        }
        # vLLM loads a folder: the policy's own tensors, so it serves the ranks' first weights
        self._folder = tempfile.TemporaryDirectory(prefix="rl_engine_vllm_")
        folder = write_vllm_folder(model, Path(self._folder.name) / "model")
        max_seq_len = model.config.max_position_embeddings
        del model
        self.engine = VllmEngine(
            folder,
            dtype=config.torch_dtype,
            max_batch_size=config.rollout.max_batch_size,
            max_seq_len=max_seq_len,
            worker_extension_cls=WORKER_EXTENSION,
        )
        return info

    def generate(self, prompts, sampling, after_env_turn: bool = False):
        """(completions, seconds spent generating)."""
        return timed(self.engine.generate, prompts, sampling, after_env_turn=after_env_turn)

    def weight_plan(self, manifest, receiver: int):
        """The worker checks the manifest against the served model (ValueError naming the
        key) and keeps a receiver of every later sync; its plan (everything)."""
        bucket = self.config.trainer.weight_sync_bucket_bytes
        return self.engine.call("rl_engine_weight_plan", manifest, receiver, bucket)

    def connect_weight_group(self, address: str, port: int, rank: int, size: int) -> None:
        timeout = self.config.trainer.collective_timeout_s
        self.engine.call("rl_engine_connect_weight_group", address, port, rank, size, timeout)

    def receive_weights(self, adapters_only: bool = False) -> int:
        """One weight sync from the trainer ranks into vLLM's model; the version now served."""
        if adapters_only:
            raise NotImplementedError("rollout.engine: vllm does not serve LoRA adapters")
        version = self.engine.call("rl_engine_receive_weights")
        self.engine.serve_version(version)
        return version

    def release_weights(self) -> int:
        """vLLM keeps its weights between syncs: nothing is released."""
        return 0
