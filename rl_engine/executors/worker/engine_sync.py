"""The worker's side of a weight sync straight into the rollout engines (a mixin of
`DeepSpeedTrainingWorker`): its manifest, joining the weight group, sending its share."""

from __future__ import annotations

from rl_engine.executors.worker.weights.weight_transport import (
    WeightGroup,
    agree_on_group,
    held_ranges,
    policy_manifest,
    weight_senders,
)
from rl_engine.rollout.weight_plan import WeightManifest, WeightPlan


class EngineWeightSync:
    """Needs the worker's module, config, comm, device, rank, world_size, zero_stage,
    weight_version and _mid_step."""

    _weight_sync = None  # (manifest, senders, group) once connect_weight_sync ran

    def weight_manifest(self) -> WeightManifest:
        """What the ranks send in a weight sync (the same on every rank): each tensor's HF name,
        aliases, shape, dtype and the flat range each rank sends (its ZeRO-3 partition)."""
        return policy_manifest(
            self.module.policy, zero3=self.zero_stage == 3, world_size=self.world_size
        )

    def connect_weight_sync(
        self, address: str, port: int, group_size: int, plans: list[WeightPlan]
    ) -> None:
        """Join the weight group (ranks 0 .. W-1 the trainer ranks, then one per receiver, whose
        `plans` are listed in group-rank order) with its store at address:port (hosted by rank 0).

        Blocks until every member has joined; the receivers join with `WeightGroup.connect`.
        """
        manifest, trainer = self.weight_manifest(), self.config.trainer
        agree_on_group(manifest, plans, group_size, self.comm)
        self.close_weight_sync()
        bucket, lora = trainer.weight_sync_bucket_bytes, self.config.lora.enabled
        senders = weight_senders(manifest, list(plans), self.rank, bucket, lora)
        device, timeout = self.device.type, trainer.collective_timeout_s
        group = WeightGroup.connect(address, port, self.rank, group_size, device, timeout)
        self._weight_sync = (manifest, senders, group)

    def send_weights(self, on_bucket=None, *, adapters_only: bool = False) -> dict[str, float]:
        """This rank's share of the current weights to every receiver of the weight group, as
        `weight_version`; every rank calls it while the receivers receive. Sends from the
        parameters' own storage (under ZeRO-3 each rank its partition): nothing is gathered.
        `adapters_only` (a LoRA policy, once the receivers hold the frozen base): the adapters.

        Returns {"weight_version", "bytes" (sent by this rank), "seconds"}.
        """
        if self._weight_sync is None:
            raise RuntimeError("send_weights before connect_weight_sync")
        self._mid_step.require_usable()
        manifest, senders, group = self._weight_sync
        if adapters_only and "adapters" not in senders:
            raise ValueError("send_weights(adapters_only=True) needs a LoRA policy (lora.rank > 0)")
        zero3 = self.zero_stage == 3
        held = held_ranges(self.module.policy, manifest, self.rank, zero3)
        sender = senders["adapters" if adapters_only else "full"]
        stats = sender.send(group, held, self.weight_version, on_bucket=on_bucket)
        return {"weight_version": self.weight_version, **stats}

    def close_weight_sync(self) -> None:
        if getattr(self, "_weight_sync", None) is not None:
            self._weight_sync[2].close()
        self._weight_sync = None
