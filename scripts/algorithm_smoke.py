"""Every algorithm as a Ray job on the demo task: reward rises, parity 1.0 every step.

    DS_ACCELERATOR=cpu .venv/bin/python scripts/algorithm_smoke.py [--steps N] [--out DIR]

configs/demo.yaml (tiny random Llama, count task, 1 engine, 1 DeepSpeed rank, strict parity)
once per case: each `algorithm.advantage` (grpo, rloo, reinforce_pp, reinforce_pp_baseline),
GSPO (`algorithm.ratio_level: sequence`), two compositions (mini-batches x epochs; DAPO's
sampling rules) and PPO with a critic (`algorithm.name: ppo`: GAE from a value model on its own
DeepSpeed rank, one warm-up step). A case passes when the mean reward of its last 3 steps is
at least 0.1 above that of its first 3 and every step's parity exact-match fraction is 1.0.
Prints a markdown table (docs/benchmarks.md) and exits 1 when a case fails.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CASES = {
    "grpo": {"algorithm": {"advantage": "grpo"}},
    "rloo": {"algorithm": {"advantage": "rloo"}},
    "reinforce_pp": {"algorithm": {"advantage": "reinforce_pp"}},
    "reinforce_pp_baseline": {"algorithm": {"advantage": "reinforce_pp_baseline"}},
    "gspo (ratio_level sequence)": {
        "algorithm": {"ratio_level": "sequence", "loss_aggregation": "seq-mean-token-mean"}
    },
    "grpo, mini_batch_size 16 x epochs 2": {"trainer": {"mini_batch_size": 16, "epochs": 2}},
    "dapo (filter_groups, overlong_penalty, clip-higher)": {
        "rollout": {"filter_groups": True},
        "algorithm": {"clip_eps_high": 0.28, "overlong_penalty": {"buffer": 4, "factor": 0.5}},
    },
    "ppo (critic, gae, warmup 1)": {
        "algorithm": {"name": "ppo"},
        "critic": {"lr": 1e-3, "warmup_steps": 1},
    },
}


def run_case(name: str, changes: dict, steps: int, out_dir: Path) -> dict:
    from rl_engine.config import RunConfig, read_yaml
    from rl_engine.executors.job.ray_job import run_job

    data = read_yaml(REPO / "configs" / "demo.yaml")
    data["trainer"]["deepspeed"] = str(REPO / data["trainer"]["deepspeed"])
    for section, values in changes.items():
        data.setdefault(section, {}).update(values)
    slug = "".join(ch if ch.isalnum() else "_" for ch in name)[:40]
    data.update(steps=steps, output_dir=str(out_dir / slug))
    data["checkpoint"] = {"every": 0, "keep_last": 1}
    started = time.perf_counter()
    history = run_job(RunConfig.from_dict(data), overwrite=True)
    rewards = [m["reward_mean"] for m in history]
    parity = [m["parity/exact_match_fraction"] for m in history]
    first, last = statistics.mean(rewards[:3]), statistics.mean(rewards[-3:])
    return {
        "first": first,
        "last": last,
        "rise": last - first,
        "min_parity": min(parity),
        "updates": sum(m["updates"] for m in history),
        "seconds": time.perf_counter() - started,
        "passed": last - first >= 0.1 and all(p == 1.0 for p in parity),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=15)
    parser.add_argument("--out", type=Path, default=None, help="run directories (default: temp)")
    parser.add_argument("--only", nargs="*", help="case names to run (default: all)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import ray

    out = args.out or Path(tempfile.mkdtemp(prefix="algorithm_smoke_"))
    # one engine, one trainer rank and (ppo) one critic rank: one logical CPU each
    ray.init(address="local", num_cpus=3, include_dashboard=False, log_to_driver=False)
    results = {}
    try:
        for name, changes in CASES.items():
            if args.only and name not in args.only:
                continue
            results[name] = run_case(name, changes, args.steps, out)
            print(f"{name}: {results[name]}", file=sys.stderr, flush=True)
    finally:
        ray.shutdown()
    print(f"configs/demo.yaml, {args.steps} steps each, 1 engine, 1 rank, parity strict\n")
    print(
        "| case | reward, first 3 steps | reward, last 3 steps | rise | min parity exact | "
        "updates | s | pass |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name, r in results.items():
        print(
            f"| {name} | {r['first']:.3f} | {r['last']:.3f} | {r['rise']:+.3f} | "
            f"{r['min_parity']:.4f} | {r['updates']} | {r['seconds']:.0f} | "
            f"{'yes' if r['passed'] else 'NO'} |"
        )
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
