"""Experiment trackers: every metrics row goes to each of `logging.backends`, under the same names.

- `jsonl`: RUN_DIR/metrics.jsonl (`run_dir.MetricsLog`), always on: resume and the summary
  read it;
- `tensorboard`: event files in RUN_DIR/tensorboard/; a resumed run writes into the same
  directory with `purge_step` = its first step, so TensorBoard drops the events of the
  redone steps and shows one run;
- `wandb`: `wandb.init` in the mode the environment sets (WANDB_MODE=offline: local run
  files under RUN_DIR/wandb/, no network); the run id is kept in RUN_DIR/trackers.json and
  a resumed run continues it (resume="allow");
- `mlflow`: MLFLOW_TRACKING_URI, or a file store in RUN_DIR/mlruns (MLflow 3 wants
  MLFLOW_ALLOW_FILE_STORE=true for it, which is set then unless already set); experiment
  `logging.project`; a resumed run logs into the same MLflow run (its id in
  trackers.json). MLflow forbids '@' in metric names: `eval/pass@k` is logged there as
  `eval/pass_at_k` (every other name unchanged).

Each row logs its numeric fields (bools as 0/1) at step = the row's `step`; text fields
(`skip_reason`) stay in metrics.jsonl only.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from pathlib import Path

from rl_engine.base.io import write_json_atomic
from rl_engine.config import RunConfig
from rl_engine.executors.job.run_dir import MetricsLog

log = logging.getLogger("rl_engine.job")

TRACKERS_STATE = "trackers.json"
# the package each backend imports, and what to install for it
PACKAGES = {
    "tensorboard": ("tensorboard", "pip install 'rl-engine[tensorboard]' (or tensorboard)"),
    "wandb": ("wandb", "pip install 'rl-engine[wandb]' (or wandb)"),
    "mlflow": ("mlflow", "pip install 'rl-engine[mlflow]' (or mlflow)"),
}


def check_backends(backends: list[str]) -> None:
    """A config error naming what to install for each backend whose package is missing."""
    import importlib.util

    for backend in backends:
        if backend in PACKAGES and importlib.util.find_spec(PACKAGES[backend][0]) is None:
            raise ValueError(
                f"logging.backends names {backend!r} but the {PACKAGES[backend][0]} package is not "
                f"installed: {PACKAGES[backend][1]}"
            )


def scalars(record: dict) -> dict[str, float]:
    """The row's numeric fields as floats (bools 0/1); text fields are left out."""
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}


class _State:
    """RUN_DIR/trackers.json: run ids that a resumed run continues."""

    def __init__(self, run_dir: Path):
        self.path = run_dir / TRACKERS_STATE
        self.data = json.loads(self.path.read_text()) if self.path.is_file() else {}

    def get(self, key: str):
        return self.data.get(key)

    def set(self, key: str, value) -> None:
        self.data[key] = value
        write_json_atomic(self.path, self.data)


class JsonlTracker:
    def __init__(self, run_dir: Path):
        self.log_file = MetricsLog(run_dir)

    def log(self, record: dict) -> None:
        self.log_file.append(record)

    def close(self) -> None:
        self.log_file.close()


class TensorBoardTracker:
    def __init__(self, run_dir: Path, first_step: int):
        from torch.utils.tensorboard import SummaryWriter

        self.directory = run_dir / "tensorboard"
        self.writer = SummaryWriter(str(self.directory), purge_step=first_step or None)

    def log(self, record: dict) -> None:
        for name, value in scalars(record).items():
            self.writer.add_scalar(name, value, global_step=record["step"])
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbTracker:
    def __init__(self, config: RunConfig, run_dir: Path, state: _State):
        import wandb

        run_id = state.get("wandb_run_id") or uuid.uuid4().hex[:12]
        self.run = wandb.init(
            project=config.logging.project,
            name=config.logging.experiment_name or run_dir.name,
            id=run_id,
            resume="allow",
            dir=str(run_dir),
            config=config.to_dict(),
            settings=wandb.Settings(console="off", silent=True),
        )
        state.set("wandb_run_id", run_id)
        log.info("wandb run %s (mode %s)", run_id, os.environ.get("WANDB_MODE", "online"))

    def log(self, record: dict) -> None:
        self.run.log(scalars(record), step=record["step"])

    def close(self) -> None:
        self.run.finish()


def mlflow_name(name: str) -> str:
    """MLflow's metric-name alphabet: '@' -> '_at_', anything else outside it -> '_'."""
    return re.sub(r"[^/\w.\- :]", "_", name.replace("@", "_at_"))


class MlflowTracker:
    def __init__(self, config: RunConfig, run_dir: Path, state: _State):
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (run_dir / "mlruns").resolve().as_uri()
            # MLflow 3 keeps the file store but refuses it unless asked; it is what a run
            # directory needs (no server, no database)
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        name = config.logging.project
        experiment = self.client.get_experiment_by_name(name)
        experiment_id = (
            experiment.experiment_id if experiment else self.client.create_experiment(name)
        )
        run_id = state.get("mlflow_run_id")
        if run_id is None:
            run = self.client.create_run(
                experiment_id, run_name=config.logging.experiment_name or run_dir.name
            )
            run_id = run.info.run_id
            state.set("mlflow_run_id", run_id)
            self._log_params(config, run_id)
        else:
            self.client.update_run(run_id, status="RUNNING")
        self.run_id, self.uri = run_id, uri
        log.info("mlflow run %s at %s", run_id, uri)

    def _log_params(self, config: RunConfig, run_id: str) -> None:
        from mlflow.entities import Param

        from rl_engine.executors.job.run_dir import flat_keys

        params = [
            Param(mlflow_name(k), str(v)[:500])
            for k, v in flat_keys(config.to_dict()).items()
            if k != "steps"  # the one key a resume may change; a changed param is refused
        ]
        for start in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[start : start + 100])

    def log(self, record: dict) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [
            Metric(mlflow_name(k), v, now, record["step"]) for k, v in scalars(record).items()
        ]
        self.client.log_batch(self.run_id, metrics=metrics)

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


class Trackers:
    """All of the run's backends; `log(record)` writes one metrics row to each."""

    def __init__(self, config: RunConfig, run_dir: Path, first_step: int):
        self.backends = []
        state = _State(run_dir)
        try:
            for name in config.logging.backends:
                if name == "jsonl":
                    self.backends.append(JsonlTracker(run_dir))
                elif name == "tensorboard":
                    self.backends.append(TensorBoardTracker(run_dir, first_step))
                elif name == "wandb":
                    self.backends.append(WandbTracker(config, run_dir, state))
                elif name == "mlflow":
                    self.backends.append(MlflowTracker(config, run_dir, state))
        except BaseException:
            self.close()
            raise

    def log(self, record: dict) -> None:
        for backend in self.backends:
            backend.log(record)

    def close(self) -> None:
        for backend in self.backends:
            try:
                backend.close()
            except Exception as err:  # one tracker failing to close must not hide the others
                log.warning("closing %s: %s", type(backend).__name__, err)
        self.backends = []
