"""What the ranks of the tensor-parallel parity tests run (spawned by rl_engine.rollout.tp.launch).

Every function here is module-level (picklable for torch.multiprocessing's spawn). A
scenario is (model key, dtype name); `build` gives the same patched model on every rank
and in the test process. `tiny-llama-1003` is tiny-llama with a vocabulary of 1003, an
MLP width of 201 (both uneven at N = 2 and 4) and ONE KV head (replicated on every rank).

`RowParallelLinear` is the negative control: a conventional Megatron row-parallel layer
(its input features split, partial products all-reduced). It lives in tests on purpose:
the package's TP modules must never sum across ranks (tests/rollout/tp/test_collectives.py).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

PROMPTS = [[5, 9, 31, 4, 77, 12, 6, 300, 41], [8, 8, 2], [11, 3, 90, 17, 450], [7] * 12, [61, 62]]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAX_BATCH = 3  # 10 sequences through 3 slots: admissions while others decode


def sampling():
    from rl_engine.rollout import SamplingParams

    # stop tokens make completions end at different steps (slots free mid-run); the seed is
    # one whose draws do so for every scenario (test_the_mix_batches_continuously checks it)
    return SamplingParams(
        n=2, max_new_tokens=5, temperature=1.0, top_k=40, seed=0, stop_token_ids=tuple(range(3, 80))
    )


def build(key: str, dtype: str):
    """The patched model of `key` (seed 0) in `dtype`."""
    from rl_engine.patching import apply_batch_invariant

    model = build_unpatched(key, dtype)
    apply_batch_invariant(model.eval())
    return model


def build_unpatched(key: str, dtype: str):
    """The model of `key` (seed 0) in `dtype`, unpatched."""
    from transformers import AutoModelForCausalLM

    from rl_engine.models.tiny import TINY_CONFIGS, build_tiny_model

    if key == "tiny-llama-1003":
        config = TINY_CONFIGS["tiny-llama"]()
        config.vocab_size, config.intermediate_size, config.num_key_value_heads = 1003, 201, 1
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model = model.to(DTYPES[dtype])
    else:
        model = build_tiny_model(key, dtype=DTYPES[dtype], seed=0)
    return model


def record(completions, stats) -> dict:
    return {
        "tokens": [c.token_ids for c in completions],
        "logprobs": [c.logprobs for c in completions],
        "finish": [c.finish_reason for c in completions],
        "batch_sizes": list(stats.batch_sizes),
        "admitted_while_running": stats.admitted_while_running,
        "packed_prefills": stats.packed_prefills,
    }


def generate_tp1(key: str, dtype: str) -> dict:
    from rl_engine.rollout import RolloutEngine

    engine = RolloutEngine(build(key, dtype), device="cpu", max_batch_size=MAX_BATCH)
    return record(engine.generate(PROMPTS, sampling()), engine.last_stats)


def generate_sharing(key: str, dtype: str, *, share: bool, tp_engine: bool = False) -> dict:
    """The prompt-sharing scenario (tests/rollout/test_prompt_sharing.py) on a TP = 1 engine
    or, `tp_engine`, on this rank of a TP engine; its record and its prefill counts."""
    from rl_engine.rollout import RolloutEngine
    from rl_engine.rollout.tp import TensorParallelEngine
    from tests.helpers.rollout.common import (
        SHARING_SLOTS,
        sharing_scenario_prompts,
        sharing_scenario_sampling,
    )

    model = build(key, dtype)
    engine_class = TensorParallelEngine if tp_engine else RolloutEngine
    engine = engine_class(
        model, device="cpu", max_batch_size=SHARING_SLOTS, share_prompt_prefill=share
    )
    vocab = model.config.vocab_size
    prompts, sampling = sharing_scenario_prompts(vocab), sharing_scenario_sampling(vocab)
    completions = engine.generate(prompts, sampling)
    stats = engine.last_stats
    out = record(completions, stats)
    out.update(shared_prefills=stats.shared_prefills, prefill_forwards=stats.prefill_forwards)
    return out


def generate_sharing_on_ranks(key: str, dtype: str, rank: int, world: int) -> dict:
    """`generate_sharing` with sharing on, on every rank of a TP engine."""
    return generate_sharing(key, dtype, share=True, tp_engine=True)


def save_weights(key: str, dtype: str, folder) -> str:
    """The seed-0 weights of `key`: an HF folder (tiny-llama: its tied head is not stored)
    or, for other models, a job checkpoint's weights file."""
    from rl_engine.executors.worker.weights.weights_file import save_state_dict

    model = build(key, dtype)
    if key == "tiny-llama":
        model.save_pretrained(folder)
        return str(folder)
    return str(save_state_dict(f"{folder}/weights.safetensors", model.state_dict()))


def load_and_generate(key: str, dtype: str, path: str) -> dict:
    """A TP engine that reads only its rows of the seed-0 weights: built from the folder's
    config (an HF folder, as a job's engine actor does), or a seed-1 model (a weights file)."""
    import os

    from rl_engine.models.tiny import build_tiny_model
    from rl_engine.patching import apply_batch_invariant
    from rl_engine.rollout.tp import TensorParallelEngine

    if os.path.isdir(path):  # what a job's TP engine actor does with an HF folder
        from rl_engine.rollout.tp.engine import engine_from_folder

        engine, _ = engine_from_folder(
            path, dtype=DTYPES[dtype], device="cpu", patch=True, max_batch_size=MAX_BATCH
        )
    else:
        model = build_tiny_model(key, dtype=DTYPES[dtype], seed=1)
        apply_batch_invariant(model.eval())
        engine = TensorParallelEngine(model, device="cpu", max_batch_size=MAX_BATCH)
    read = engine.load_shards(path, version=5)
    result = record(engine.generate(PROMPTS, sampling()), engine.last_stats)
    files = [path] if os.path.isfile(path) else [f"{path}/{f}" for f in os.listdir(path)]
    on_disk = sum(os.path.getsize(f) for f in files if f.endswith(".safetensors"))
    result["versions"] = [c.weight_version for c in engine.generate(PROMPTS[:1], sampling())]
    from rl_engine.rollout.tp.shard import weight_targets

    held = sum(t.numel() * t.element_size() for t in weight_targets(engine.model).values())
    result["bytes"] = {
        "read": engine.shards.gather_objects(read),
        "held": engine.shards.gather_objects(held),
        "on_disk": on_disk,
    }
    return result


def run_parts(parts: dict, rank: int, world: int) -> dict:
    """Several scenarios in one TP world, one after another: {name: part(rank, world)}. One
    spawn of ranks (each an interpreter importing torch) serves the tests of a module."""
    return {name: part(rank, world) for name, part in parts.items()}


def generate_sharded(
    scenarios, row_parallel: tuple[str, str] | None, rank: int, world: int, loads=()
):
    """Each scenario on a TP engine of `world` ranks; row_parallel: one scenario also run
    with Megatron's row-parallel o_proj / down_proj (the negative control); loads:
    (key, dtype, path) whose seed-0 weights a TP engine reads shard by shard."""
    from rl_engine.rollout.tp import TensorParallelEngine

    out = {("load", key, dtype): load_and_generate(key, dtype, path) for key, dtype, path in loads}
    for key, dtype in scenarios:
        engine = TensorParallelEngine(build(key, dtype), device="cpu", max_batch_size=MAX_BATCH)
        out[key, dtype] = record(engine.generate(PROMPTS, sampling()), engine.last_stats)
        out[key, dtype]["receiver"] = receiver_shares(engine, key, dtype)
    if row_parallel is not None:
        engine = TensorParallelEngine(build(*row_parallel), device="cpu", max_batch_size=MAX_BATCH)
        make_row_parallel(engine.model, rank, world)
        out["row_parallel"] = record(engine.generate(PROMPTS, sampling()), engine.last_stats)
    return out


def receiver_shares(engine, key: str, dtype: str) -> dict:
    """What each rank's weight-sync receiver takes of the full policy's manifest (its own
    plan): its bytes, and the bytes of each tensor it takes only a slice of, by rank."""
    from rl_engine.executors.worker.weights.weight_transport import policy_manifest

    manifest = policy_manifest(build(key, dtype), zero3=False, world_size=1)
    receiver = engine.weight_receiver(manifest, bucket_bytes=1 << 20)
    specs = {s.name: s for s in manifest.tensors}
    sliced = {
        name: _prod(receiver.plan.target_shape(specs[name])) * specs[name].torch_dtype.itemsize
        for name, piece in receiver.plan.slices.items()
        if piece is not None
    }
    mine = {"nbytes": receiver.nbytes, "sliced": sliced}
    full = {s.name: s.numel * s.torch_dtype.itemsize for s in manifest.tensors}
    return {"manifest": manifest.nbytes, "full": full, "ranks": engine.shards.gather_objects(mine)}


def _prod(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


class RowParallelLinear(nn.Module):
    """Megatron's row-parallel linear: input columns [k0, k1) here, partial sums all-reduced."""

    def __init__(self, sharded, full_weight: torch.Tensor, cols: tuple[int, int]):
        super().__init__()
        self.op, self.weight = sharded.op, full_weight[:, cols[0] : cols[1]].contiguous()

    def forward(self, x_local):
        partial = self.op(x_local.float(), self.weight.float(), None)  # fp32 partial sums
        dist.all_reduce(partial)  # the reduction whose order depends on the TP degree
        return partial.to(x_local.dtype)


def make_row_parallel(model, rank: int, world: int) -> None:
    """Swap o_proj and down_proj of a sharded model for row-parallel layers (their inputs,
    the local heads' attention output and the local MLP width, are exactly the K shards)."""
    from rl_engine.rollout.tp.shard import tp_layout

    layout = tp_layout(model)
    reference = build_full_weights(model)
    for index, layer in enumerate(model.base_model.layers):
        q0, q1 = layout.rows("q", rank)
        m0, m1 = layout.rows("mlp", rank)
        attn, mlp = layer.self_attn, layer.mlp
        attn.o_proj = RowParallelLinear(attn.o_proj, reference[index, "o"], (q0, q1))
        mlp.down_proj = RowParallelLinear(mlp.down_proj, reference[index, "down"], (m0, m1))


def build_full_weights(model) -> dict:
    """Every rank's o_proj / down_proj rows gathered back into the full weights."""
    full = {}
    for index, layer in enumerate(model.base_model.layers):
        for tag, module in (("o", layer.self_attn.o_proj), ("down", layer.mlp.down_proj)):
            pieces = [None] * dist.get_world_size()
            dist.all_gather_object(pieces, module.weight.detach())
            full[index, tag] = torch.cat(pieces, dim=0)
    return full


SPECULATIVE = (("tiny-llama", "fp32"), ("tiny-qwen3", "bf16"))


def generate_speculative(rank: int, world: int) -> dict:
    """Speculating TP engines (prompt lookup; the policy itself as a replicated draft model),
    for comparison with the TP = 1 engine without speculation."""
    from rl_engine.rollout.speculative import SpeculativeParams
    from rl_engine.rollout.tp import TensorParallelEngine

    out = {}
    for key, dtype in SPECULATIVE:
        for method in ("ngram", "draft_model"):
            params = SpeculativeParams(method=method, num_tokens=3)
            draft = build(key, dtype) if method == "draft_model" else None
            engine = TensorParallelEngine(
                build(key, dtype),
                device="cpu",
                max_batch_size=MAX_BATCH,
                speculative=params,
                draft_model=draft,
            )
            result = record(engine.generate(PROMPTS, sampling()), engine.last_stats)
            result["speculation"] = engine.last_stats.speculation
            out[f"{key}/{dtype}/{method}"] = result
    return out
