"""A job step's metrics row: the trainer's metrics, the reward, and where the time went.

Wall-clock figures live under `time/` (a resumed run's metrics equal an uninterrupted
run's on every other key):

- `time/rollout`: generation (or reading `rollout.source`) and rewards;
  `time/generate_compute`: the slowest engine's own generation time; `time/reward`: scoring;
- `time/batch`: building the TrainBatch;
- `time/train`: the driver's wait for the ranks; `time/train_compute`: the slowest rank's own;
- `time/weight_sync`: the whole weight sync, from the driver's call until every rank has
  sent and every engine has received in place (0 when the engines serve the version already);
- `time/eval`: validation (when one ran in the step);
- asynchronous runs (rollout.max_staleness >= 1): `time/generate_ahead`, the generation of
  later steps' rollouts beside the training (hidden behind it up to `async/overlap`), and
  `time/behaviour_check`, the ranks' check of those rollouts against the weights that sampled
  them;
- `time/step`: all of the above; `time/driver_overhead` (and `_fraction`): what is neither
  generation, training compute nor validation.
"""

from __future__ import annotations

import time
from contextlib import contextmanager


class StepClock:
    """Times a step's phases (`with clock.phase("train"): ...`) and takes figures the actors report."""

    def __init__(self):
        self.started = time.perf_counter()
        self.times: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str):
        mark = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, time.perf_counter() - mark)

    def add(self, name: str, seconds: float) -> None:
        key = f"time/{name}"
        self.times[key] = self.times.get(key, 0.0) + seconds

    def totals(self) -> dict[str, float]:
        """Every phase, plus time/step (so far) and the driver's overhead."""
        t = {"time/generate_compute": 0.0, **self.times}
        t["time/step"] = time.perf_counter() - self.started
        busy = t["time/generate_compute"] + t["time/train_compute"] + t.get("time/eval", 0.0)
        overhead = t["time/step"] - busy
        t["time/driver_overhead"] = overhead
        t["time/driver_overhead_fraction"] = overhead / t["time/step"]
        return t


def step_record(
    step: int, trainer: dict, rewards: list[float], extra: dict, times: dict[str, float]
) -> dict:
    """One line of metrics.jsonl: rank 0's (all-reduced) metrics, the step, the reward, the
    dataset / reward / eval figures (`extra`), the times."""
    return {**trainer, "step": step, "reward_mean": sum(rewards) / len(rewards), **extra, **times}
