"""What the ranks of the tensor-parallel LoRA tests run (spawned by rl_engine.rollout.tp.launch).

A scenario's policy is its `tp_procs` model (seed 0) with a PEFT adapter on every linear
(rank 4, alpha 8), A and B perturbed by a seeded generator (B != 0: the adapter matters),
patched and unmerged. Each engine generates the tp_procs request, then takes a weight update
of the whole policy with the adapters redrawn (what a later sync delivers: `load_weights`
cuts each rank's rows) and generates again.
"""

from __future__ import annotations

from tests.helpers.rollout.tp_procs import MAX_BATCH, PROMPTS, build_unpatched, record, sampling

RANK = 4


def build_lora(key: str, dtype: str, *, seed: int = 7, merged: bool = False):
    """The patched LoRA policy of `key`; `merged`: its adapters folded into W (the negative control)."""
    from rl_engine.patching import apply_batch_invariant
    from rl_engine.patching.lora import add_lora
    from tests.helpers.lora_policy import merge_adapters, perturb_adapters

    model = build_unpatched(key, dtype)
    add_lora(model, rank=RANK, alpha=2 * RANK, target_modules="all-linear", seed=0)
    perturb_adapters(model, seed=seed)
    if merged:
        merge_adapters(model)
    apply_batch_invariant(model.eval())
    return model


def redrawn(key: str, dtype: str) -> dict:
    """The full state dict of the policy with other adapters (seed 11): a later sync's content."""
    return {k: v.detach().clone() for k, v in build_lora(key, dtype, seed=11).state_dict().items()}


def run(engine, key: str, dtype: str) -> dict:
    first = record(engine.generate(PROMPTS, sampling()), engine.last_stats)
    engine.load_weights(redrawn(key, dtype), version=1)
    second = record(engine.generate(PROMPTS, sampling()), engine.last_stats)
    return {"first": first, "after_sync": second}


def lora_tp1(key: str, dtype: str) -> dict:
    from rl_engine.rollout import RolloutEngine

    return run(
        RolloutEngine(build_lora(key, dtype), device="cpu", max_batch_size=MAX_BATCH), key, dtype
    )


def lora_sharded(scenarios, rank: int, world: int) -> dict:
    """Each scenario's runs and weight plan on this rank of a TP engine; "merged": the first
    scenario with its adapters merged into W, on the TP engine."""
    from rl_engine.rollout.tp import TensorParallelEngine

    out = {}
    for key, dtype in scenarios:
        engine = TensorParallelEngine(
            build_lora(key, dtype), device="cpu", max_batch_size=MAX_BATCH
        )
        out[key, dtype] = {"plan": plan(engine, key, dtype), **run(engine, key, dtype)}
    merged = build_lora(*scenarios[0], merged=True)
    engine = TensorParallelEngine(merged, device="cpu", max_batch_size=MAX_BATCH)
    out["merged"] = record(engine.generate(PROMPTS, sampling()), engine.last_stats)
    return out


def plan(engine, key: str, dtype: str) -> dict:
    """What this rank's receiver takes of the LoRA policy's manifest: per tensor None (whole)
    or its rows; the bytes of a full sync and of an adapters-only sync; the manifest's shapes."""
    from rl_engine.executors.worker.weights.weight_transport import adapter_names, policy_manifest
    from rl_engine.rollout.weight_receiver import WeightReceiver

    manifest = policy_manifest(build_lora(key, dtype), zero3=False, world_size=1)
    receiver = engine.weight_receiver(manifest, bucket_bytes=1 << 20)
    names = adapter_names(manifest)
    only = receiver.plan.only(names)
    targets = {n: t for n, t in engine.model.state_dict(keep_vars=True).items() if n in set(names)}
    adapters = WeightReceiver(targets, manifest, only, 0, 1 << 20)
    rows = {
        name: None if piece is None else [list(r) for r in piece.ranges]
        for name, piece in receiver.plan.slices.items()
    }
    mine = {"rows": rows, "nbytes": receiver.nbytes, "adapter_nbytes": adapters.nbytes}
    return {
        "shapes": {s.name: list(s.shape) for s in manifest.tensors},
        "itemsize": {s.name: s.torch_dtype.itemsize for s in manifest.tensors},
        "adapters": sorted(names),
        "ranks": engine.shards.gather_objects(mine),
    }
