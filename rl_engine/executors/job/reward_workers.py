"""`RewardPool`: `reward.num_workers` Ray processes that score samples in parallel.

Each worker loads the reward function once (`reward.function`, a verl file or a
built-in) and scores one sample per call under `reward.timeout_s` in its own main
thread (`rl_engine.rewards.call_score`). The driver keeps at most one call in flight
per worker, so every sample's clock starts when its call starts. A call that has not
answered `KILL_GRACE_S` after its time limit (a reward stuck in C code the signal
cannot interrupt), or whose worker died, is scored as a timeout / error and its
worker is killed and replaced: a reward never hangs the job.

Workers ask Ray for no CPU (`num_cpus=0`): they run between generation and training,
when the engines and ranks are idle, and a cluster whose CPUs the job's actors fill
still schedules them.
"""

from __future__ import annotations

import logging
import time
from collections import deque

import ray
from ray.exceptions import RayActorError, RayTaskError

from rl_engine.rewards import RewardSample, Score

log = logging.getLogger("rl_engine.job")

KILL_GRACE_S = 2.0


@ray.remote(num_cpus=0, max_restarts=0)
class RewardWorker:
    """One process with the reward function loaded."""

    def __init__(self, spec: str | None, kwargs: dict, timeout_s: float):
        import logging as _logging

        from rl_engine.rewards import load_reward_function

        _logging.getLogger("math_verify").setLevel(_logging.ERROR)
        self.fn, self.kwargs, self.timeout_s = load_reward_function(spec, kwargs), kwargs, timeout_s

    def ready(self) -> bool:
        return True

    def score(self, sample: RewardSample) -> Score:
        from rl_engine.rewards import call_score

        return call_score(self.fn, sample, self.kwargs, self.timeout_s)


class RewardPool:
    """`score(samples)` -> one Score per sample, in order, from `size` worker processes."""

    def __init__(self, spec: str | None, kwargs: dict, timeout_s: float, size: int):
        self.spec, self.kwargs, self.timeout_s = spec, kwargs, timeout_s
        self.workers = [self._spawn() for _ in range(size)]
        self.replaced = 0
        ray.get([w.ready.remote() for w in self.workers])

    def _spawn(self):
        return RewardWorker.remote(self.spec, self.kwargs, self.timeout_s)

    def _replace(self, worker):
        """Kill `worker` and start another (ready before it is used)."""
        ray.kill(worker, no_restart=True)
        self.replaced += 1
        fresh = self._spawn()
        ray.get(fresh.ready.remote())
        return fresh

    def score(self, samples: list[RewardSample]) -> list[Score]:
        results: list[Score | None] = [None] * len(samples)
        waiting = deque(range(len(samples)))
        idle = list(self.workers)
        running: dict = {}  # ref -> (sample index, worker, hard deadline)
        limit = self.timeout_s + KILL_GRACE_S
        while waiting or running:
            while waiting and idle:
                index, worker = waiting.popleft(), idle.pop()
                ref = worker.score.remote(samples[index])
                running[ref] = (index, worker, time.monotonic() + limit)
            first_deadline = min(deadline for _, _, deadline in running.values())
            ready, _ = ray.wait(
                list(running), num_returns=1, timeout=max(0.0, first_deadline - time.monotonic())
            )
            for ref in ready:
                index, worker, _ = running.pop(ref)
                try:
                    results[index] = ray.get(ref)
                    idle.append(worker)
                except (RayActorError, RayTaskError) as err:
                    results[index] = Score(0.0, error=f"the reward worker died: {_first_line(err)}")
                    idle.append(self._replace(worker))
            now = time.monotonic()
            for ref, (index, worker, deadline) in list(running.items()):
                if now >= deadline:
                    del running[ref]
                    results[index] = Score(
                        0.0,
                        timed_out=True,
                        error=f"took more than reward.timeout_s = {self.timeout_s:g} s (worker killed)",
                    )
                    log.warning(
                        "reward of %s timed out: its worker is replaced", samples[index].where
                    )
                    idle.append(self._replace(worker))
        self.workers = idle
        return results

    def close(self) -> None:
        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception as err:  # already gone
                log.debug("kill reward worker: %s", err)
        self.workers = []


def _first_line(err: BaseException) -> str:
    lines = [line for line in str(err).splitlines() if line.strip()]
    return lines[-1].strip()[:200] if lines else type(err).__name__
