"""The `logging:` section: the experiment trackers (executors/job/trackers.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rl_engine.base.fields import check_choice, check_text, fail

BACKENDS = ("jsonl", "tensorboard", "wandb", "mlflow")


@dataclass(kw_only=True, slots=True)
class LoggingConfig:
    """Where each step's scalars go besides metrics.jsonl: the same names in every backend."""

    backends: list[str] = field(default_factory=lambda: ["jsonl"])
    """Any of 'jsonl' (RUN_DIR/metrics.jsonl, always on: resume reads it), 'tensorboard'
    (RUN_DIR/tensorboard), 'wandb' (mode from WANDB_MODE; files under RUN_DIR/wandb),
    'mlflow' (MLFLOW_TRACKING_URI, else a file store in RUN_DIR/mlruns)."""
    project: str = "rl_engine"
    """W&B project / MLflow experiment name."""
    experiment_name: str | None = None
    """W&B / MLflow run name (null: the run directory's name)."""

    def __post_init__(self) -> None:
        if isinstance(self.backends, str):
            self.backends = [self.backends]
        self._check_backends()
        check_text("logging.project", self.project)
        if self.experiment_name is not None:
            check_text("logging.experiment_name", self.experiment_name)

    def _check_backends(self) -> None:
        """A non-empty list of known backends, each once, jsonl among them."""
        if not isinstance(self.backends, list) or not self.backends:
            fail("logging.backends", f"a non-empty list of {list(BACKENDS)}", self.backends)
        for backend in self.backends:
            check_choice("logging.backends", backend, BACKENDS)
        if len(set(self.backends)) != len(self.backends):
            fail("logging.backends", "a list without repeats", self.backends)
        if "jsonl" not in self.backends:
            fail(
                "logging.backends",
                "a list that includes 'jsonl' (metrics.jsonl is the run's record: resume and "
                "the summary read it)",
                self.backends,
            )
