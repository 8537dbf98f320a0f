"""The real-size job benchmark's table (`rl-engine bench job`) and the machine it ran on.

One column per run (`invariant`, `plain`: full weights; `lora`: the LoRA policy, invariant),
then the ratios: `ratio` (invariant / plain) when both ran, `lora / full` (lora / invariant,
the full-weight run of the same shape and numerics) when both ran.
"""

from __future__ import annotations

import os
import subprocess

from rl_engine.benchmarks.job_memory import GIB, available_bytes, meminfo

MODES = ("invariant", "plain", "lora")
RATIOS = (("ratio", "invariant", "plain"), ("lora / full", "lora", "invariant"))
"""(column, numerator run, denominator run) of each ratio column."""
FIGURES = (
    ("weight sync s (median, steps 1..)", "weight_sync_s", "{:.2f}"),
    ("train compute s", "train_compute_s", "{:.1f}"),
    ("generate compute s", "generate_compute_s", "{:.1f}"),
    ("step s", "step_s", "{:.1f}"),
    ("peak extra system memory GiB", "peak_extra_gib", "{:.2f}"),
    ("peak of the job's own memory GiB (PSS of its processes)", "peak_job_pss_gib", "{:.2f}"),
    ("weight_sync/bytes MiB, first sync", "sync_first_mib", "{:.3g}"),
    ("weight_sync/bytes MiB, later syncs (median)", "sync_later_mib", "{:.3g}"),
)
"""(row title, figure key, format) of the rows that get ratios."""


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
        "available_gib": available_bytes() / GIB,
        "total_gib": meminfo()["MemTotal"] / GIB,
    }


def markdown(results: list[dict], env_before: dict, env_after: dict, label: str) -> str:
    """The table of `results` (run_mode's figures, one per run) under `label`, then the CPU."""
    by_mode = {r["mode"]: r for r in results}
    modes = [m for m in MODES if m in by_mode]
    ratios = [(title, a, b) for title, a, b in RATIOS if a in by_mode and b in by_mode]
    blank = " |" * len(ratios)
    lines = [
        f"{label}",
        "",
        "| | " + " | ".join([*modes, *(title for title, _, _ in ratios)]) + " |",
        "|---|" + "---:|" * (len(modes) + len(ratios)),
    ]
    for title, key, fmt in FIGURES:
        values = {m: by_mode[m].get(key) for m in modes}
        cells = [fmt.format(v) if v is not None else "-" for v in values.values()]
        for _, a, b in ratios:
            cells.append(_ratio(values[a], values[b]))
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    lines += _process_rows(results, modes, "peak RSS MiB", "peak_rss_mib", blank)
    lines += _process_rows(results, modes, "PSS MiB at the job's peak", "pss_at_peak_mib", blank)
    cells = []
    for m in modes:
        span = by_mode[m]["driver_rss_during_steps_mib"]
        cells.append(f"{span[0]:.0f}-{span[1]:.0f}" if span else "-")
    lines.append("| driver RSS MiB over the steps | " + " | ".join(cells) + " |" + blank)
    cells = [
        ", ".join("-" if p is None else f"{p:g}" for p in by_mode[m]["parity_exact"]) for m in modes
    ]
    lines.append("| parity exact-match per step | " + " | ".join(cells) + " |" + blank)
    lines += [
        "",
        f"CPU: {env_before['cpu']} ({env_before['cpus']} CPUs; {' '.join(env_before['flags'])}), "
        f"{env_before['total_gib']:.0f} GiB; load average before {env_before['load_average']}, "
        f"after {env_after['load_average']}; available memory before {env_before['available_gib']:.1f} GiB.",
    ]
    return "\n".join(lines)


def _ratio(a: float | None, b: float | None) -> str:
    """a / b: two decimals, or two significant digits below 0.1 (a LoRA run's sync bytes
    are a few thousandths of the full run's at the tiny shape)."""
    if not a or not b:
        return "-"
    r = a / b
    return f"{r:.2f}x" if r >= 0.1 else f"{r:.2g}x"


def _process_rows(results: list[dict], modes: list[str], title: str, key: str, blank: str):
    """One row per process name of the `key` figures ({name: MiB}), '-' where a run had none."""
    by_mode = {r["mode"]: r.get(key) or {} for r in results}
    names = sorted({n for figures in by_mode.values() for n in figures})
    rows = []
    for name in names:
        cells = [f"{by_mode[m][name]:.0f}" if name in by_mode[m] else "-" for m in modes]
        rows.append(f"| {title}, {name} | " + " | ".join(cells) + " |" + blank)
    return rows
