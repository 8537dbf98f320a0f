"""The run directory (`output_dir`): who may write into it, and its append-only metrics log.

Layout:

    RUN_DIR/config.yaml       the run's config snapshot (what `--resume` continues)
    RUN_DIR/metrics.jsonl     one JSON line per step, appended and flushed as the step ends
    RUN_DIR/summary.json      config + every step's metrics (written atomically at the end)
    RUN_DIR/training.png      reward and parity per step (atomic)
    RUN_DIR/actors.json       role, rank, node and pid of every actor of the latest start
    RUN_DIR/checkpoints/      see `rl_engine.executors.job.job_checkpoints`

An existing run is never written into by accident: a new run refuses a directory that
holds one unless it is resumed (`--resume`) or replaced (`--overwrite`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from rl_engine.base.io import FILE_MODE, write_text_atomic

CONFIG_SNAPSHOT = "config.yaml"
METRICS = "metrics.jsonl"


class RunDirError(ValueError):
    """The run directory cannot be used as asked (exit code 2)."""


def prepare_run_dir(path: str | Path, *, resume: bool, overwrite: bool) -> Path:
    """Check (and for a new run create) the run directory; an existing run needs resume/overwrite."""
    run_dir = Path(path)
    holds_run = (run_dir / CONFIG_SNAPSHOT).is_file()
    if resume:
        if not holds_run:
            raise RunDirError(
                f"--resume {str(run_dir)!r}: no run there (no {CONFIG_SNAPSHOT}); "
                "start it with --config instead"
            )
    elif run_dir.exists() and (not run_dir.is_dir() or any(run_dir.iterdir())):
        if not overwrite:
            raise RunDirError(
                f"output_dir {str(run_dir)!r} already exists and is not empty; pass "
                f"--resume {run_dir} to continue that run or --overwrite to replace it"
            )
        if not holds_run:
            raise RunDirError(
                f"--overwrite: output_dir {str(run_dir)!r} holds files but no run "
                f"(no {CONFIG_SNAPSHOT}); refusing to delete it"
            )
        shutil.rmtree(run_dir)
    check_writable(run_dir)
    return run_dir


def check_writable(run_dir: Path) -> None:
    """Create `run_dir` if needed and prove a file can be written there."""
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=run_dir, prefix=".write-test."):
            pass
    except OSError as err:
        raise RunDirError(
            f"output_dir {str(run_dir)!r} is not writable: {err.strerror or err}"
        ) from None


def read_metrics(run_dir: Path) -> list[dict]:
    """The records of metrics.jsonl; a torn last line (a crash mid-write) is dropped."""
    path = Path(run_dir) / METRICS
    if not path.is_file():
        return []
    records = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            break  # only the line being written when the run died can be torn
    return records


def truncate_metrics(run_dir: Path, next_step: int) -> list[dict]:
    """Keep the records of steps < next_step (a resumed run redoes the rest); atomic rewrite."""
    kept = [m for m in read_metrics(run_dir) if m["step"] < next_step]
    write_text_atomic(Path(run_dir) / METRICS, "".join(metrics_line(m) for m in kept))
    return kept


def metrics_line(record: dict) -> str:
    return json.dumps(record, sort_keys=True, default=float) + "\n"


class MetricsLog:
    """metrics.jsonl opened for appending: each record is written and flushed as its step ends."""

    def __init__(self, run_dir: Path):
        path = Path(run_dir) / METRICS
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 - closed by close()
        os.chmod(path, FILE_MODE)

    def append(self, record: dict) -> None:
        self._file.write(metrics_line(record))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def resume_config(run_dir: str | Path, config_path: str | None, overrides: list[str]):
    """The config a resumed run continues with: the run's own snapshot, `steps` may be raised.

    A `--config` (with its `--set`s) given anyway must equal the snapshot except for
    `steps`; `--set` alone may change only `steps`. Under trainer.layout_invariant the layout
    keys (LAYOUT_KEYS, and the DeepSpeed config's zero_optimization) may change too: the run
    continues bitwise on the new layout. The result's output_dir is `run_dir`.
    """
    from rl_engine.config import RunConfig, apply_overrides, read_yaml

    run_dir = Path(run_dir)
    snapshot_path = run_dir / CONFIG_SNAPSHOT
    if not snapshot_path.is_file():
        raise RunDirError(f"--resume {str(run_dir)!r}: no run there (no {CONFIG_SNAPSHOT})")
    snapshot = RunConfig.from_yaml(snapshot_path).to_dict()
    if config_path is not None:
        wanted = RunConfig.from_yaml(config_path, overrides).to_dict()
    else:
        wanted = RunConfig.from_dict(apply_overrides(read_yaml(snapshot_path), overrides)).to_dict()
    if config_path is not None and Path(wanted["output_dir"]).resolve() != run_dir.resolve():
        raise RunDirError(
            f"--resume {run_dir}: {config_path} has output_dir {wanted['output_dir']!r}, "
            "another run directory"
        )
    differences = [
        key
        for key in flat_keys(snapshot)
        if key not in ("steps", "output_dir")
        and flat_keys(snapshot)[key] != flat_keys(wanted).get(key)
    ]
    elastic = snapshot["trainer"]["layout_invariant"] and wanted["trainer"]["layout_invariant"]
    layout = [key for key in differences if _is_layout_key(key, snapshot, wanted)]
    if layout and not elastic and len(layout) == len(differences):
        raise RunDirError(
            f"--resume {run_dir}: the layout changes ({_listed(layout, snapshot, wanted)}); "
            "a run resumes on another layout only with trainer.layout_invariant: true"
        )
    if elastic:
        differences = [key for key in differences if key not in layout]
    if differences:
        listed = ", ".join(
            f"{k} ({flat_keys(snapshot)[k]!r} in the run, {flat_keys(wanted).get(k)!r} given)"
            for k in differences
        )
        raise RunDirError(
            f"--resume {run_dir}: the config differs from the run's snapshot in {listed}; only "
            "steps may change on resume"
        )
    if wanted["steps"] < snapshot["steps"]:
        raise RunDirError(
            f"--resume {run_dir}: steps may only be raised (the run has {snapshot['steps']}, "
            f"given {wanted['steps']})"
        )
    if elastic:  # the new layout's keys, everything else the snapshot's
        return RunConfig.from_dict({**wanted, "output_dir": str(run_dir)})
    return RunConfig.from_dict({**snapshot, "steps": wanted["steps"], "output_dir": str(run_dir)})


LAYOUT_KEYS = (
    "trainer.num_ranks",
    "trainer.zero_stage",
    "trainer.micro_batch_size",
    "trainer.max_tokens_per_micro_batch",
    "trainer.packing",
    "trainer.placement",
    "critic.num_ranks",
    "critic.zero_stage",
)


def _is_layout_key(key: str, snapshot: dict, wanted: dict) -> bool:
    """A layout key, or trainer.deepspeed differing in its zero_optimization only."""
    if key in LAYOUT_KEYS:
        return True
    if key != "trainer.deepspeed":
        return False
    a, b = snapshot["trainer"]["deepspeed"], wanted["trainer"]["deepspeed"]
    if not (isinstance(a, dict) and isinstance(b, dict)):
        return False
    return {k: v for k, v in a.items() if k != "zero_optimization"} == {
        k: v for k, v in b.items() if k != "zero_optimization"
    }


def _listed(keys, snapshot: dict, wanted: dict) -> str:
    flat_a, flat_b = flat_keys(snapshot), flat_keys(wanted)
    return ", ".join(f"{k} {flat_a[k]!r} -> {flat_b.get(k)!r}" for k in keys)


def flat_keys(data: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in data.items():
        if isinstance(value, dict) and key != "deepspeed":
            out.update(flat_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out
