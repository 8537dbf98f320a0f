"""One process of the weight-sync test: `python -m tests.helpers.rollout.weight_sync_procs ROLE INDEX PORT OUT`.

Two senders (group ranks 0, 1: every tensor split evenly between them, as ranks that
hold the whole model send) and two receivers (ranks 2, 3) run three syncs over one real
gloo weight group:

1. tiny-llama (tied head) of seed 1 into two RolloutEngines of seed 0, plan "everything",
   each engine's weights released (`release_weights`) before the sync refills them;
2. tiny-qwen2 of seed 1 into two sets of shard tensors: `split_plans` (rows of the
   column-parallel weights, columns of the row-parallel ones, an uneven vocabulary split);
3. tiny-llama again, and sender 1 exits after its first bucket: the receivers must fail,
   keep their published version and refuse to generate.

Each receiver saves what it got to OUT/receiver{INDEX}.pt; the test compares.
"""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import torch

SENDERS, RECEIVERS = 2, 2
BUCKET = 1 << 20
SMALL_BUCKET = 32 << 10  # many buckets: the fault lands mid-sync
VERSIONS = (7, 8, 9)
PROMPTS = [[5, 9, 31, 4, 77], [8, 8, 2, 40], [11, 3]]


def sampling():
    from rl_engine.rollout import SamplingParams

    return SamplingParams(n=2, max_new_tokens=6, temperature=0.9, seed=5)


def model(name: str, seed: int):
    from rl_engine.models import load_model

    return load_model(name, dtype=torch.float32, seed=seed)[0]


def manifest_of(policy):
    from rl_engine.executors.worker.weights.weight_transport import policy_manifest

    return policy_manifest(policy, zero3=False, world_size=SENDERS)


def split_plans(manifest):
    """Tensor-parallel-like plans for 2 receivers: output rows of q/k/v/gate/up (and their
    biases), input columns of o/down, the vocabulary rows of embedding and head split unevenly."""
    from rl_engine.rollout.weight_plan import DimSlice, WeightPlan

    plans = [dict.fromkeys((s.name for s in manifest.tensors), None) for _ in range(RECEIVERS)]
    for spec in manifest.tensors:
        name, shape = spec.name, spec.shape
        if any(k in name for k in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")):
            dim = 0
        elif any(k in name for k in ("o_proj", "down_proj")):
            dim = 1
        elif "embed_tokens" in name or "lm_head" in name:
            dim = 0
        else:
            continue
        cut = shape[dim] // 2 + (1 if "embed" in name or "lm_head" in name else 0)
        plans[0][name] = DimSlice(dim, ((0, cut),))
        plans[1][name] = DimSlice(dim, ((cut, shape[dim]),))
    return [WeightPlan(p) for p in plans]


def run_sender(index: int, group) -> None:
    from rl_engine.executors.worker.weights.weight_transport import WeightSender, held_ranges
    from rl_engine.rollout.weight_plan import WeightPlan

    for version, name, plans_of, bucket in (
        (VERSIONS[0], "tiny-llama", lambda m: [WeightPlan.everything(m)] * RECEIVERS, BUCKET),
        (VERSIONS[1], "tiny-qwen2", split_plans, BUCKET),
        (VERSIONS[2], "tiny-llama", lambda m: [WeightPlan.everything(m)] * RECEIVERS, SMALL_BUCKET),
    ):
        policy = model(name, seed=1)
        manifest = manifest_of(policy)
        sender = WeightSender(manifest, plans_of(manifest), index, bucket)
        held = held_ranges(policy, manifest, index, zero3=False)
        if version != VERSIONS[2]:
            sender.send(group, held, version)
            continue

        def die(_version, _bucket):
            if index == 1:
                os._exit(0)  # a sender gone mid-sync (its process ends, its sockets close)

        try:
            sender.send(group, held, version, on_bucket=die)
        except RuntimeError:
            pass  # sender 0: the receivers stopped listening


def run_receiver(index: int, group, out: Path) -> None:
    from rl_engine.patching import apply_batch_invariant
    from rl_engine.rollout import RolloutEngine
    from rl_engine.rollout.weight_plan import WeightPlan
    from rl_engine.rollout.weight_receiver import WeightReceiver

    result = {}
    policy = model("tiny-llama", seed=0)
    apply_batch_invariant(policy)
    engine = RolloutEngine(policy, device="cpu", max_batch_size=3, progress=False)
    result["before"] = engine.generate(PROMPTS, sampling())
    receiver = engine.weight_receiver(manifest_of(policy), receiver=index, bucket_bytes=BUCKET)
    result["packed_before_release"] = engine.packed_weights.nbytes
    result["released"] = engine.release_weights(receiver)  # the sync refills them
    result["packed_after_release"] = engine.packed_weights.nbytes
    try:
        engine.generate(PROMPTS, sampling())
        result["generate_released"] = "generated"
    except RuntimeError as err:
        result["generate_released"] = str(err)
    result["version"] = engine.receive_weights(receiver, group)
    result["after"] = engine.generate(PROMPTS, sampling())
    result["state"] = {k: v.clone() for k, v in policy.state_dict().items()}

    qwen = model("tiny-qwen2", seed=0)
    manifest = manifest_of(qwen)
    plan = split_plans(manifest)[index]
    shards = {s.name: torch.zeros(plan.target_shape(s)) for s in manifest.tensors}
    result["split_version"] = WeightReceiver(shards, manifest, plan, index, BUCKET).receive(group)
    result["shards"], result["plan"] = shards, plan

    receiver = engine.weight_receiver(
        manifest_of(policy),
        WeightPlan.everything(manifest_of(policy)),
        receiver=index,
        bucket_bytes=SMALL_BUCKET,
    )
    buckets: list[int] = []
    try:
        engine.receive_weights(receiver, group, on_bucket=lambda v, b: buckets.append(b))
        result["fault"] = "the sync completed"
    except RuntimeError as err:
        result["fault"] = str(err)
    result["fault_buckets"] = len(buckets)
    result["version_after_fault"] = engine.weight_version
    try:
        engine.generate(PROMPTS, sampling())
        result["generate_after_fault"] = "generated"
    except RuntimeError as err:
        result["generate_after_fault"] = str(err)
    torch.save(result, out / f"receiver{index}.pt")


def main(role: str, index: int, port: int, out: Path) -> int:
    from rl_engine.executors.worker.weights.weight_transport import WeightGroup

    torch.set_num_threads(1)
    rank = index if role == "sender" else SENDERS + index
    group = WeightGroup.connect("127.0.0.1", port, rank, SENDERS + RECEIVERS, "cpu", 60.0)
    try:
        if role == "sender":
            run_sender(index, group)
        else:
            run_receiver(index, group, out)
    except Exception:
        (out / f"{role}{index}.error").write_text(traceback.format_exc())
        return 1
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
    role, index, port, out = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    sys.exit(main(role, index, port, out))
