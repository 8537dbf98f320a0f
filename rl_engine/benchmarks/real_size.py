"""`rl-engine bench job`: the real-size job, measured as a user runs it (`scripts/bench_real_size.py`).

Builds a Qwen2.5-shaped model with random weights (saved once in bf16, with
`save_pretrained`, to a cache folder outside the repository), then runs
`rl-engine train` on it (bf16, 2 ZeRO-3 ranks, 1 engine, 16 completions of 32
tokens a step) with batch_invariant true and false, one after the other, and with
`--lora RANK` (> 0) a third time: the LoRA policy (lora.rank RANK, alpha 2 x RANK, all
linears; invariant), beside the full-weight runs of the same shape. `--activation-checkpointing`
turns trainer.activation_checkpointing on in every run (off by default: at this shape it did not
lower a rank's peak, docs/benchmarks.md). It reads off:

- the medians, over the steps after the first, of `time/weight_sync`,
  `time/train_compute`, `time/generate_compute` (and `time/step`);
- `weight_sync/bytes` of the first sync (step 0) and the median of the later ones (a LoRA
  run's later syncs move its adapters alone);
- the memory figures of `job_memory.Sampler`: peak extra system memory, each process's peak
  RSS, the driver's RSS over the steps, the peak of the job's own PSS and each process's
  share of it.

A guard kills the run (its whole process group) when the machine's available memory
falls below `--guard-gib`: a model that does not fit is reported as such instead of
taking other processes down with it. The table: `real_size_report.markdown`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.job_memory import GIB, Sampler
from rl_engine.benchmarks.real_size_report import environment, markdown
from rl_engine.benchmarks.timing import child_env

# Qwen2.5 configs (hidden, layers, heads, kv heads, intermediate), all with tied embeddings
# and the family's vocabulary; `--layers` cuts a shape to fewer layers. qwen2.5-tiny is no
# released model: the smoke run's (`--tiny`), the family's vocabulary on a tiny body.
QWEN25 = {
    "qwen2.5-0.5b": (896, 24, 14, 2, 4864),
    "qwen2.5-1.5b": (1536, 28, 12, 2, 8960),
    "qwen2.5-3b": (2048, 36, 16, 2, 11008),
    "qwen2.5-tiny": (64, 2, 4, 2, 128),
}
# --tiny: the tiny shape, 2 steps of 1 x 4 completions of 4 tokens
TINY_ARGS = {
    "shape": "qwen2.5-tiny",
    "steps": 2,
    "prompts": 1,
    "samples": 4,
    "max_new_tokens": 4,
    "micro_batch_size": 2,
}
VOCAB = 151936
MIB = 2**20


def model_dir(cache: Path, shape: str, layers: int | None, seed: int) -> Path:
    """The saved model of `shape` (cut to `layers`), built the first time it is asked for."""
    hidden, n_layers, heads, kv, inter = QWEN25[shape]
    layers = layers or n_layers
    path = cache / f"{shape}-L{layers}-seed{seed}"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    import torch

    from rl_engine.models.build import hf_config, random_model

    config = hf_config(
        "qwen2",
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        tie_word_embeddings=True,
        max_position_embeddings=32768,
        rope_theta=1_000_000.0,
        rms_norm_eps=1e-6,
        use_sliding_window=False,
        bos_token_id=151643,
        eos_token_id=151643,
    )
    started = time.perf_counter()
    torch.manual_seed(seed)
    model = random_model(config, torch.bfloat16)
    staging = path.with_name(path.name + ".tmp")
    model.save_pretrained(staging, safe_serialization=True)
    os.replace(staging, path)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"built {path} ({params / 1e6:.0f} M parameters) in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    return path


def job_config(
    model: Path,
    run_dir: Path,
    invariant: bool,
    args,
    *,
    lora_rank: int = 0,
    activation_checkpointing: bool = False,
) -> dict:
    """The job a new user writes for this model: bf16, 2 ZeRO-3 ranks, 1 engine,
    `activation_checkpointing` (the bench passes one value to every run, so the ratios
    compare like with like);
    with `lora_rank` > 0 a LoRA policy of that rank (alpha 2 x rank) on every linear."""
    config = {
        "model": str(model),
        "dtype": "bfloat16",
        "seed": args.seed,
        "batch_invariant": invariant,
        "parity": "strict" if invariant else "report",
        "output_dir": str(run_dir),
        "steps": args.steps,
        "rollout": {
            "num_engines": 1,
            "max_batch_size": args.prompts * args.samples,
            "prompts_per_step": args.prompts,
            "samples_per_prompt": args.samples,
            "max_new_tokens": args.max_new_tokens,
        },
        "trainer": {
            "num_ranks": 2,
            "zero_stage": 3,
            "micro_batch_size": args.micro_batch_size,
            "lr": 1e-6,
            "activation_checkpointing": activation_checkpointing,
        },
    }
    if lora_rank > 0:
        config["lora"] = {"rank": lora_rank, "alpha": 2 * lora_rank, "target_modules": "all-linear"}
    return config


def run_mode(model: Path, mode: str, args) -> dict:
    """One `rl-engine train` of the job (`mode`: invariant, plain or lora); its figures."""
    run_dir = args.out / mode
    config_path = args.out / f"{mode}.yaml"
    lora_rank = args.lora if mode == "lora" else 0
    config = job_config(
        model,
        run_dir,
        mode != "plain",
        args,
        lora_rank=lora_rank,
        activation_checkpointing=args.activation_checkpointing,
    )
    config_path.write_text(yaml.safe_dump(config))
    log_path = args.out / f"{mode}.log"
    started = time.time()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "rl_engine.cli",
                "train",
                "--config",
                str(config_path),
                "--overwrite",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=child_env(),
        )
        sampler = Sampler(
            run_dir,
            proc.pid,
            int(args.guard_gib * GIB),
            lambda: os.killpg(proc.pid, signal.SIGKILL),
        )
        try:
            code = proc.wait()
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            sampler.stop()
    wall = time.time() - started
    metrics = _metrics(run_dir)
    later = metrics[1:] or metrics
    figures = {
        "mode": mode,
        "exit_code": code,
        "wall_s": wall,
        "steps": len(metrics),
        "guard_tripped": sampler.guard_tripped,
        "peak_extra_gib": (sampler.peak_used - sampler.baseline) / GIB,
        "peak_job_pss_gib": sampler.peak_job_pss / GIB,
        "peak_rss_mib": {k: v / MIB for k, v in sorted(sampler.peak_hwm.items())},
        "rss_at_system_peak_mib": {k: v / MIB for k, v in sorted(sampler.at_peak.items())},
        "pss_at_peak_mib": {k: v / MIB for k, v in sorted(sampler.pss_at_peak.items())},
        "driver_rss_during_steps_mib": _driver_range(sampler),
        "parity_exact": [m.get("parity/exact_match_fraction") for m in metrics],
        "parity_max_abs_diff": [m.get("parity/max_abs_diff") for m in metrics],
    }
    for key in ("weight_sync", "train_compute", "generate_compute", "step"):
        values = [m[f"time/{key}"] for m in later if f"time/{key}" in m]
        figures[f"{key}_s"] = statistics.median(values) if values else None
        figures[f"{key}_all_s"] = [round(m.get(f"time/{key}", float("nan")), 3) for m in metrics]
    sent = [m["weight_sync/bytes"] / MIB for m in metrics if "weight_sync/bytes" in m]
    figures["sync_first_mib"] = sent[0] if sent else None
    figures["sync_later_mib"] = statistics.median(sent[1:]) if sent[1:] else None
    return figures


def _metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _driver_range(sampler: Sampler) -> list[float] | None:
    """[min, max] MiB of the driver's RSS from the end of the first step to the end of the run."""
    if sampler.first_step_done is None:
        return None
    values = [v for t, v in sampler.driver_rss if t >= sampler.first_step_done]
    return [min(values) / MIB, max(values) / MIB] if values else None


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick="4 layers of the shape, 2 steps")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(QWEN25))
    parser.add_argument(
        "--model", type=Path, default=None, help="a saved HF folder instead of --shape"
    )
    parser.add_argument(
        "--layers", type=int, default=None, help="cut the shape to this many layers"
    )
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--modes", default="invariant,plain", help="full-weight runs, of: invariant,plain"
    )
    parser.add_argument(
        "--lora",
        type=int,
        default=0,
        metavar="RANK",
        help="> 0: also run the LoRA policy (lora.rank RANK, alpha 2 x RANK, all linears)",
    )
    parser.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="trainer.activation_checkpointing in every run (default: off)",
    )
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache" / "rl_engine" / "models"
    )
    parser.add_argument("--out", type=Path, default=Path("runs") / "bench_real_size")
    parser.add_argument(
        "--guard-gib", type=float, default=1.5, help="kill the run below this much available memory"
    )
    args = parser.parse_args(argv)
    modes = _modes(parser, args)
    if args.quick:
        args.layers, args.steps = 4, 2
    if args.tiny:
        vars(args).update(TINY_ARGS)
    args.cache.mkdir(parents=True, exist_ok=True)
    args.out.mkdir(parents=True, exist_ok=True)
    env_before = environment()
    print(json.dumps(env_before), flush=True)
    model = args.model or model_dir(args.cache, args.shape, args.layers, args.seed)
    results = []
    for mode in modes:
        figures = run_mode(model, mode, args)
        print(json.dumps(figures), flush=True)
        results.append(figures)
    env_after = environment()
    what = f"--model {args.model}" if args.model else f"--shape {args.shape}"
    label = (
        f"`python scripts/bench_real_size.py {what}"
        + (f" --layers {args.layers}" if args.layers else "")
        + (f" --lora {args.lora}" if args.lora else "")
        + (" --activation-checkpointing" if args.activation_checkpointing else "")
        + f" --steps {args.steps}` ({args.prompts} x {args.samples} completions of "
        f"{args.max_new_tokens} tokens a step, seed {args.seed}; every run with "
        f"trainer.activation_checkpointing: {str(args.activation_checkpointing).lower()})"
    )
    report = markdown(results, env_before, env_after, label)
    (args.out / "report.md").write_text(report + "\n")
    (args.out / "results.json").write_text(
        json.dumps({"env": [env_before, env_after], "results": results}, indent=2)
    )
    print(report)
    return 0 if all(r["exit_code"] == 0 for r in results) else 1


def _modes(parser, args) -> list[str]:
    """The runs to make: --modes (full weights), then lora when --lora > 0."""
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in ("invariant", "plain")]
    if unknown:
        parser.error(f"--modes {args.modes}: {unknown} unknown; the modes are invariant,plain")
    if args.lora < 0:
        parser.error(f"--lora must be a rank >= 0, got {args.lora}")
    return modes + ["lora"] * (args.lora > 0)
