"""`ExactWorkerExtension`: what an RL job asks of a vLLM worker, through `collective_rpc`.

vLLM mixes `worker_extension_cls` into each of its workers; the methods below then run in
the process that holds the model, by name: `llm.collective_rpc("rl_engine_...", args=...)`
(the way verl and OpenRLHF drive vLLM). They give the job's vLLM engine actor
(vllm_rollout.py) rl_engine's sampler and a weight sync from the DeepSpeed ranks straight
into the served model's parameters: the worker joins the job's weight group itself and receives the
ranks' buckets in place (rollout/weight_receiver.py), as the own engine does.

Only with `RL_ENGINE_BATCH_INVARIANT=1`: the served model must be `ExactCausalLM`.
"""

from __future__ import annotations

from rl_engine.rollout.vllm.checks import ExactVllmUnsupported


class ExactWorkerExtension:
    """Mixed into vLLM's worker class (`self.model_runner` is the worker's)."""

    def rl_engine_install_sampler(self) -> None:
        """Draw every token with rl_engine's position-keyed sampler (sampler.py)."""
        from rl_engine.rollout.vllm.sampler import ExactSampler

        self.model_runner.sampler = ExactSampler(self.model_runner, self._rl_engine_model())

    def rl_engine_weight_plan(self, manifest, receiver: int, bucket_bytes: int):
        """Check the trainer ranks' manifest against the served model (ValueError naming the
        key) and keep a receiver of every later sync; returns its plan."""
        from rl_engine.rollout.weight_plan import WeightPlan
        from rl_engine.rollout.weight_receiver import WeightReceiver

        targets = self._rl_engine_model().hf.state_dict(keep_vars=True)
        plan = WeightPlan.everything(manifest)
        self._rl_engine_receiver = WeightReceiver(targets, manifest, plan, receiver, bucket_bytes)
        return plan

    def rl_engine_connect_weight_group(
        self, address: str, port: int, rank: int, size: int, timeout_s: float
    ) -> None:
        from rl_engine.executors.worker.weights.weight_transport import WeightGroup

        group = getattr(self, "_rl_engine_group", None)
        if group is not None:
            group.close()
        self._rl_engine_group = WeightGroup.connect(address, port, rank, size, "cpu", timeout_s)

    def rl_engine_receive_weights(self) -> int:
        """One sync from the ranks into the served parameters in place; returns its version."""
        receiver = getattr(self, "_rl_engine_receiver", None)
        if receiver is None:
            raise RuntimeError("rl_engine_receive_weights before rl_engine_weight_plan")
        try:
            return receiver.receive(self._rl_engine_group)
        finally:  # even a sync that failed half-way wrote parameters: repack them
            self._rl_engine_model().weights_changed()

    def _rl_engine_model(self):
        from rl_engine.rollout.vllm.model import ExactCausalLM

        model = self.model_runner.get_model()
        if not isinstance(model, ExactCausalLM):
            raise ExactVllmUnsupported(
                f"vLLM serves {type(model).__name__}, not rl_engine's ExactCausalLM: set "
                "RL_ENGINE_BATCH_INVARIANT=1 in the vLLM process"
            )
        return model
