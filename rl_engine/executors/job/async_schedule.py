"""Asynchronous RL (`rollout.max_staleness` k >= 1): the rollouts of later steps are generated while the ranks train.

The timeline of step t, whose ranks train from weight version v (the engines serve v too):

    ranks    | train step t on its rollouts (generated earlier, by v - s, s <= k)  | verify |
    engines  | generate later steps' rollouts with v  ...  (finish the one begun)  |        | sync v+1

- Which steps are generated beside step t (`AsyncPipeline.ahead`): `deterministic` (the
  default) generates every step up to t + k, so step s's rollouts always come from the version
  the ranks hold at step max(0, s - k): a function of the step, whatever the timing, and two runs
  (or a resumed one) train on the same batches. `free` stops once the ranks are done, as soon as
  the next step's rollouts exist and the batch in flight is finished: the ranks never wait for
  the window to fill, and which version generates what depends on timing.
- An engine finishes the batch it began before the sync (verl's "partial rollout" is not done):
  every token of a sample comes from one version (`Completion.weight_version`), the one its
  behaviour logprobs are checked against.
- Checked: after the step, every rank scores the new rollouts with the weights that sampled them
  (`DeepSpeedTrainingWorker.verify_behaviour`, the snapshot taken before its update) and the
  parity/* figures travel with the rollouts to the step that trains them.
- Pending rollouts are saved in every checkpoint (`save`, `restore`: rollout files with their
  figures), so a resumed run trains on the very batches the uninterrupted one did. Rollouts
  more than k versions old when their step comes (a resume with a smaller k) are dropped,
  counted in async/dropped, and generated again.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from rl_engine.base.io import write_json_atomic
from rl_engine.envs.files import parse_episode_rollouts, write_episodes

log = logging.getLogger("rl_engine.job")

PENDING = "pending_rollouts"


@dataclass
class ReadyRollouts:
    """One step's rollouts, generated (and scored) ahead of its training."""

    step: int
    completions: list
    rewards: list[float]
    metrics: dict
    """What generating them reported: reward/*, rollout/*, env/*, data/* figures."""
    parity: dict = field(default_factory=dict)
    """The behaviour check's parity/* figures (empty until it ran)."""

    @property
    def version(self) -> int:
        return int(self.completions[0].weight_version)


@dataclass
class Overlap:
    """Seconds of generation in one step: hidden behind training, or waited for."""

    hidden: float = 0.0
    exposed: float = 0.0

    def fraction(self) -> float:
        total = self.hidden + self.exposed
        return self.hidden / total if total > 0 else 0.0


class AsyncPipeline:
    """The rollouts generated ahead of their steps, and the generation beside each step's training.

    `generate(step) -> ReadyRollouts`: the step's rollouts by the engines' current weights;
    `verify(rollouts) -> dict`: the ranks' parity/* of rollouts against the weights that sampled
    them (called after the step's training, before the sync).
    """

    def __init__(self, config, generate: Callable, verify: Callable):
        self.k, self.order = config.rollout.max_staleness, config.rollout.async_order
        self.steps = config.steps
        self.generate, self.verify = generate, verify
        self.pending: dict[int, ReadyRollouts] = {}
        self.published: list[int] = []  # the versions the engines served, oldest first
        self._waited = 0.0  # the step's generation that nothing hid (its own, when not pending)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl-engine-generate")

    def take(self, step: int, version: int, clock=None) -> tuple[ReadyRollouts, dict]:
        """Step `step`'s rollouts and the async/* figures of taking them: generated now when
        none are pending (the first step, or after a drop), else the pending ones. `version`:
        the weights the ranks train from (and the engines serve) at this step."""
        self._publish(version)
        dropped, started = 0, time.perf_counter()
        ready = self.pending.pop(step, None)
        if ready is not None and self.staleness(ready) > self.k:
            dropped = len(ready.completions)
            log.warning(
                "step %d: its rollouts of weight version %d are %d versions old, more than "
                "rollout.max_staleness = %d: dropped and generated again",
                step,
                ready.version,
                self.staleness(ready),
                self.k,
            )
            ready = None
        self._waited = 0.0
        if ready is None:
            ready = self.generate(step, clock)
            self._waited = time.perf_counter() - started
        staleness = float(self.staleness(ready))
        return ready, {
            "async/staleness_mean": staleness,  # one version per step's rollouts: mean = max
            "async/staleness_max": staleness,
            "async/dropped": float(dropped),
        }

    def _publish(self, version: int) -> None:
        """`version` is the one the engines serve from now on (a skipped update publishes none)."""
        if not self.published or self.published[-1] != version:
            self.published.append(version)
        del self.published[: -(self.k + 2)]  # older ones are too old to train on anyway

    def staleness(self, ready: ReadyRollouts) -> int:
        """Versions the engines were sent after the one that sampled `ready`: a step of several
        optimizer updates (mini-batches, epochs) publishes one version, as it syncs once.
        Rollouts of a version no longer listed are older than any the run may train on."""
        if ready.version not in self.published:
            return self.k + 1
        return len(self.published) - 1 - self.published.index(ready.version)

    def beside(self, step: int, train: Callable, clock=None):
        """`train()` with the later steps' rollouts generated at the same time; returns
        (train's result, the async/* figures). Then the new rollouts are verified. `clock`
        (a StepClock) takes time/generate_ahead and time/behaviour_check."""
        trained_done = threading.Event()
        started = time.perf_counter()
        ahead = self._pool.submit(self._generate_ahead, step, trained_done)
        try:
            result = train()
        finally:
            trained_done.set()
            train_seconds = time.perf_counter() - started
            generated, generate_seconds = ahead.result()  # the engines finish what they began
        if not generated:
            generate_seconds = 0.0  # (the last steps: nothing left to generate)
        overlap = Overlap(
            hidden=min(generate_seconds, train_seconds),
            exposed=max(generate_seconds - train_seconds, 0.0) + self._waited,
        )
        checked = time.perf_counter()
        for ready in generated:
            ready.parity = self.verify(ready)
            self.pending[ready.step] = ready
        if clock is not None:
            clock.add("generate_ahead", generate_seconds)
            clock.add("behaviour_check", time.perf_counter() - checked)
        return result, {"async/overlap": overlap.fraction(), "async/generated": len(generated)}

    def _generate_ahead(self, step: int, trained_done: threading.Event):
        started, generated = time.perf_counter(), []
        for later in self.ahead(step):
            if self.order == "free" and trained_done.is_set() and later > step + 1:
                break  # free: the ranks are done and the next step's rollouts exist
            generated.append(self.generate(later))
        return generated, time.perf_counter() - started

    def ahead(self, step: int) -> list[int]:
        """The steps whose rollouts are generated beside step `step`'s training, in order: every
        step up to `step + k` not pending yet (steps 1..k beside step 0, then one a step)."""
        last = min(step + self.k, self.steps - 1)
        return [s for s in range(step + 1, last + 1) if s not in self.pending]

    # ------------------------------------------------------------------ checkpoints

    def save(self, folder: Path) -> dict:
        """The pending rollouts as rollout files under `folder`/pending_rollouts/ (with their
        rewards); returns their figures for state.json."""
        root = folder / PENDING
        root.mkdir(parents=True, exist_ok=True)
        figures = {}
        for step, ready in sorted(self.pending.items()):
            saved = [replace(c, reward=r) for c, r in zip(ready.completions, ready.rewards)]
            write_episodes(root / f"step_{step}.jsonl", saved)
            figures[str(step)] = {"metrics": ready.metrics, "parity": ready.parity}
        write_json_atomic(root / "figures.json", figures)
        return {"pending_steps": sorted(self.pending), "published_versions": self.published}

    def restore(self, folder: Path, driver: dict) -> None:
        """The pending rollouts a checkpoint saved (none in a synchronous run's) and the
        versions published before it (`driver`: its state.json "driver")."""
        self.published = [int(v) for v in driver.get("published_versions", [])]
        root = folder / PENDING
        if not (root / "figures.json").is_file():
            return
        figures = json.loads((root / "figures.json").read_text(encoding="utf-8"))
        for key, saved in figures.items():
            parsed = parse_episode_rollouts(root / f"step_{key}.jsonl")
            completions = [replace(c, reward=None) for c in parsed.completions]
            rewards = [float(c.reward) for c in parsed.completions]
            self.pending[int(key)] = ReadyRollouts(
                int(key), completions, rewards, saved["metrics"], saved["parity"]
            )

    def close(self) -> None:
        self._pool.shutdown(wait=True)
