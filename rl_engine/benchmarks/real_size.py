"""`rl-engine bench job`: the real-size job, measured as a user runs it (`scripts/bench_real_size.py`).

Builds a Qwen2.5-shaped model with random weights (saved once in bf16, with
`save_pretrained`, to a cache folder outside the repository), then runs
`rl-engine train` on it (bf16, 2 ZeRO-3 ranks, 1 engine, 16 completions of 32
tokens a step) with batch_invariant true and false, one after the other, and reads
off:

- the medians, over the steps after the first, of `time/weight_sync`,
  `time/train_compute`, `time/generate_compute` (and `time/step`);
- peak extra memory: the rise of system-wide used memory (MemTotal - MemAvailable)
  over the whole run, sampled every 0.5 s, from just before the command starts;
- each process's peak RSS (VmHWM: the driver, every trainer rank, the engine) and the
  driver's RSS from its first step to its last (flat, or not);
- the peak of the job's own memory: the PSS summed over every process of the command's
  session (driver, actors, Ray's own daemons), which other work on a shared machine does
  not move (the system-wide figure does).

A guard kills the run (its whole process group) when the machine's available memory
falls below `--guard-gib`: a model that does not fit is reported as such instead of
taking other processes down with it.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from rl_engine.benchmarks.args import bench_parser
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
SAMPLE_S = 0.5
GIB = 2**30


def model_dir(cache: Path, shape: str, layers: int | None, seed: int) -> Path:
    """The saved model of `shape` (cut to `layers`), built the first time it is asked for."""
    hidden, n_layers, heads, kv, inter = QWEN25[shape]
    layers = layers or n_layers
    path = cache / f"{shape}-L{layers}-seed{seed}"
    if (path / "config.json").is_file() and (path / "model.safetensors").is_file():
        return path
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(
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
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    staging = path.with_name(path.name + ".tmp")
    model.save_pretrained(staging, safe_serialization=True)
    os.replace(staging, path)
    params = sum(p.numel() for p in model.parameters())
    print(
        f"built {path} ({params / 1e6:.0f} M parameters) in {time.perf_counter() - started:.0f} s",
        flush=True,
    )
    return path


def job_config(model: Path, run_dir: Path, invariant: bool, args) -> dict:
    """The job a new user writes for this model: bf16, 2 ZeRO-3 ranks, 1 engine."""
    return {
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
        },
    }


@dataclass
class Sampler:
    """System-wide used memory and each job process's RSS / peak RSS, every SAMPLE_S seconds."""

    run_dir: Path
    driver_pid: int
    guard_bytes: int
    kill: callable
    baseline: int = 0
    peak_used: int = 0
    peak_hwm: dict = field(default_factory=dict)  # process name -> peak VmHWM bytes
    driver_rss: list = field(default_factory=list)  # (time, bytes)
    at_peak: dict = field(default_factory=dict)  # process name -> RSS when system use peaked
    guard_tripped: bool = False
    peak_job_pss: int = 0  # PSS summed over the command's session
    first_step_done: float | None = None  # when metrics.jsonl got its first line

    def __post_init__(self):
        self.baseline = self.peak_used = _used_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            used, available = _used_bytes(), _available_bytes()
            rss = {}
            for name, pid in self._processes().items():
                status = _status(pid)
                if status:
                    rss[name] = status["VmRSS"]
                    self.peak_hwm[name] = max(self.peak_hwm.get(name, 0), status["VmHWM"])
            if "driver" in rss:
                self.driver_rss.append((time.time(), rss["driver"]))
            if self.first_step_done is None and _non_empty(self.run_dir / "metrics.jsonl"):
                self.first_step_done = time.time()
            if used > self.peak_used:
                self.peak_used, self.at_peak = used, rss
            self.peak_job_pss = max(self.peak_job_pss, _session_pss(self.driver_pid))
            if available < self.guard_bytes and not self.guard_tripped:
                self.guard_tripped = True
                self.kill()
            self._stop.wait(SAMPLE_S)

    def _processes(self) -> dict[str, int]:
        found = {"driver": self.driver_pid}
        try:
            actors = json.loads((self.run_dir / "actors.json").read_text())
        except (OSError, ValueError):
            return found
        for a in actors:
            found[f"{a['role']} {a['rank']}"] = a["pid"]
        return found

    def stop(self):
        self._stop.set()
        self._thread.join()


def _session_pss(session: int) -> int:
    """Bytes of PSS summed over the processes of `session` (PSS splits shared pages fairly)."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:  # field 6 of stat: the session id
                continue
            with open(f"/proc/{entry}/smaps_rollup") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("Pss:")) * 1024
        except (OSError, StopIteration, IndexError, ValueError):
            continue
    return total


def _non_empty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def _meminfo() -> dict[str, int]:
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def _used_bytes() -> int:
    info = _meminfo()
    return info["MemTotal"] - info["MemAvailable"]


def _available_bytes() -> int:
    return _meminfo()["MemAvailable"]


def _status(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    out = {}
    for line in lines:
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out if len(out) == 2 else None


def run_mode(model: Path, invariant: bool, args) -> dict:
    """One `rl-engine train` of the job; its figures."""
    mode = "invariant" if invariant else "plain"
    run_dir = args.out / mode
    config_path = args.out / f"{mode}.yaml"
    config_path.write_text(yaml.safe_dump(job_config(model, run_dir, invariant, args)))
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
        "peak_rss_mib": {k: v / 2**20 for k, v in sorted(sampler.peak_hwm.items())},
        "rss_at_system_peak_mib": {k: v / 2**20 for k, v in sorted(sampler.at_peak.items())},
        "driver_rss_during_steps_mib": _driver_range(sampler),
        "parity_exact": [m.get("parity/exact_match_fraction") for m in metrics],
        "parity_max_abs_diff": [m.get("parity/max_abs_diff") for m in metrics],
    }
    for key in ("weight_sync", "train_compute", "generate_compute", "step"):
        values = [m[f"time/{key}"] for m in later if f"time/{key}" in m]
        figures[f"{key}_s"] = statistics.median(values) if values else None
        figures[f"{key}_all_s"] = [round(m.get(f"time/{key}", float("nan")), 3) for m in metrics]
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
    return [min(values) / 2**20, max(values) / 2**20] if values else None


def environment() -> dict:
    """CPU model and flags, load average, free memory: what the figures depend on."""
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    fields = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    model = fields.get("Model name", "?").strip()
    flags = fields.get("Flags", "").split()
    wanted = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")
    return {
        "cpu": model,
        "cpus": os.cpu_count(),
        "flags": [f for f in wanted if f in flags],
        "load_average": os.getloadavg(),
        "available_gib": _available_bytes() / GIB,
        "total_gib": _meminfo()["MemTotal"] / GIB,
    }


def markdown(results: list[dict], env_before: dict, env_after: dict, label: str) -> str:
    rows = [
        ("weight sync s (median, steps 1..)", "weight_sync_s", "{:.2f}"),
        ("train compute s", "train_compute_s", "{:.1f}"),
        ("generate compute s", "generate_compute_s", "{:.1f}"),
        ("step s", "step_s", "{:.1f}"),
        ("peak extra system memory GiB", "peak_extra_gib", "{:.2f}"),
        ("peak of the job's own memory GiB (PSS of its processes)", "peak_job_pss_gib", "{:.2f}"),
    ]
    by_mode = {r["mode"]: r for r in results}
    modes = [m for m in ("invariant", "plain") if m in by_mode]
    lines = [
        f"{label}",
        "",
        "| | " + " | ".join(modes) + (" | ratio |" if len(modes) == 2 else " |"),
    ]
    lines.append("|---|" + "---:|" * (len(modes) + (len(modes) == 2)))
    for title, key, fmt in rows:
        values = [by_mode[m].get(key) for m in modes]
        cells = [fmt.format(v) if v is not None else "-" for v in values]
        if len(modes) == 2:
            a, b = values
            cells.append(f"{a / b:.2f}x" if a and b else "-")
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    names = sorted({n for r in results for n in r["peak_rss_mib"]})
    for name in names:
        cells = [f"{by_mode[m]['peak_rss_mib'].get(name, float('nan')):.0f}" for m in modes]
        lines.append(
            f"| peak RSS MiB, {name} | " + " | ".join(cells) + (" | |" if len(modes) == 2 else " |")
        )
    cells = []
    for m in modes:
        span = by_mode[m]["driver_rss_during_steps_mib"]
        cells.append(f"{span[0]:.0f}-{span[1]:.0f}" if span else "-")
    lines.append(
        "| driver RSS MiB over the steps | "
        + " | ".join(cells)
        + (" | |" if len(modes) == 2 else " |")
    )
    cells = [
        ", ".join("-" if p is None else f"{p:g}" for p in by_mode[m]["parity_exact"]) for m in modes
    ]
    lines.append(
        "| parity exact-match per step | "
        + " | ".join(cells)
        + (" | |" if len(modes) == 2 else " |")
    )
    lines += [
        "",
        f"CPU: {env_before['cpu']} ({env_before['cpus']} CPUs; {' '.join(env_before['flags'])}), "
        f"{env_before['total_gib']:.0f} GiB; load average before {env_before['load_average']}, "
        f"after {env_after['load_average']}; available memory before {env_before['available_gib']:.1f} GiB.",
    ]
    return "\n".join(lines)


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
    parser.add_argument("--modes", default="invariant,plain")
    parser.add_argument(
        "--cache", type=Path, default=Path.home() / ".cache" / "rl_engine" / "models"
    )
    parser.add_argument("--out", type=Path, default=Path("runs") / "bench_real_size")
    parser.add_argument(
        "--guard-gib", type=float, default=1.5, help="kill the run below this much available memory"
    )
    args = parser.parse_args(argv)
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
    for mode in args.modes.split(","):
        figures = run_mode(model, mode == "invariant", args)
        print(json.dumps(figures), flush=True)
        results.append(figures)
    env_after = environment()
    what = f"--model {args.model}" if args.model else f"--shape {args.shape}"
    label = (
        f"`python scripts/bench_real_size.py {what}"
        + (f" --layers {args.layers}" if args.layers else "")
        + f" --steps {args.steps}` ({args.prompts} x {args.samples} completions of "
        f"{args.max_new_tokens} tokens a step, seed {args.seed})"
    )
    report = markdown(results, env_before, env_after, label)
    (args.out / "report.md").write_text(report + "\n")
    (args.out / "results.json").write_text(
        json.dumps({"env": [env_before, env_after], "results": results}, indent=2)
    )
    print(report)
    return 0 if all(r["exit_code"] == 0 for r in results) else 1
