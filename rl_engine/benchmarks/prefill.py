"""`rl-engine bench rollout --case prefill`: the engine's multi-prompt prefill, packed vs padded.

A patched RolloutEngine (SmolLM2-135M-shaped model, random init, batch_invariant
on) prefills 8 prompts and samples one token (`max_new_tokens=1`: the prefill
forward and one LM-head call, no decode), once with every multi-prompt prefill
right-padded and once packed into one row (`rl_engine.rollout.stepper.PACK_PREFILL`
forced to inf / 0 in this process). Prompt-length mixes: all equal, mildly and
widely spread, one long prompt with short ones. Best of `repeats` interleaved
runs. The engine's default packs when the padded batch would compute more than
PACK_PREFILL times the real tokens; the table's padded/real column shows where
each mix falls. `--tiny`: a 1-layer model of a tiny config, the mixes 16 times shorter.
"""

from __future__ import annotations

import time

import torch

import rl_engine.rollout.stepper as stepper_module
from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.packing import SMOLLM2_SHAPE, TINY_SHAPE, smollm2_shaped_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams

MIXES = {
    "8 x 128 (equal)": [128] * 8,
    "96..160 (mild)": [96, 104, 112, 120, 136, 144, 152, 160],
    "16..256 (wide)": [16, 48, 80, 112, 144, 176, 208, 256],
    "1 x 512 + 7 x 32": [512] + [32] * 7,
}


def _prefill_seconds(engine, prompts, threshold: float) -> float:
    stepper_module.PACK_PREFILL = threshold
    start = time.perf_counter()
    engine.generate(prompts, SamplingParams(max_new_tokens=1, seed=0))
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> str:
    parser = bench_parser(__doc__, quick="4 of the 30 layers, best of 2")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    layers, repeats = (4, 2) if args.quick else (30, 3)
    shape, mixes = SMOLLM2_SHAPE, MIXES
    if args.tiny:
        layers, repeats, shape = 1, 1, TINY_SHAPE
        mixes = {name: [max(1, n // 16) for n in lengths] for name, lengths in MIXES.items()}
    model = smollm2_shaped_model(layers, shape).to(dtype)
    apply_batch_invariant(model)
    engine = RolloutEngine(model, device="cpu", max_batch_size=8, progress=False)
    g = torch.Generator().manual_seed(0)
    default = stepper_module.PACK_PREFILL
    rows = []
    try:
        for name, lengths in mixes.items():
            prompts = [torch.randint(3, shape[0], (n,), generator=g).tolist() for n in lengths]
            _prefill_seconds(engine, prompts, 0.0)  # warm-up
            padded, packed = [], []
            for _ in range(repeats):
                padded.append(_prefill_seconds(engine, prompts, float("inf")))
                packed.append(_prefill_seconds(engine, prompts, 0.0))
            ratio = len(lengths) * max(lengths) / sum(lengths)
            rows.append(
                f"| {name} | {ratio:.2f} | {min(padded) * 1e3:.1f} | {min(packed) * 1e3:.1f} | "
                f"{min(packed) / min(padded):.2f}x | {'packed' if ratio > default else 'padded'} |"
            )
    finally:
        stepper_module.PACK_PREFILL = default
    lines = [
        f"RolloutEngine prefill of 8 prompts + 1 sampled token, "
        f"{'tiny (prompts / 16)' if args.tiny else 'SmolLM2-135M-shaped'} ({layers} "
        f"layers, random init), {str(dtype).removeprefix('torch.')}, batch_invariant on, threads "
        f"{torch.get_num_threads()}, best of {repeats} interleaved",
        "",
        "| prompt lengths | padded / real tokens | padded ms | packed ms | packed / padded | default |",
        "|---|---:|---:|---:|---:|---|",
        *rows,
    ]
    table = "\n".join(lines)
    print(table)
    return table
