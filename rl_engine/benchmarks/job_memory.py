"""The memory of a running job, read from /proc every SAMPLE_S seconds (`rl-engine bench job`).

`Sampler` follows one command started in a session of its own (the driver) and the actors it
lists in its run's `actors.json`, and keeps:

- peak extra memory: the rise of system-wide used memory (MemTotal - MemAvailable) over the
  whole run, from just before the command starts;
- each process's peak RSS (VmHWM) and its RSS when system use peaked; the driver's RSS over
  time;
- the peak of the job's own memory: the PSS summed over every process of the command's
  session (driver, actors, Ray's own daemons), which other work on a shared machine does not
  move (the system-wide figure does), and each process's PSS at that peak: where it went.

A guard calls `kill` when the machine's available memory falls below `guard_bytes`: a model
that does not fit is reported as such instead of taking other processes down with it.
"""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

SAMPLE_S = 0.5
GIB = 2**30
OTHER = "other (Ray's daemons and workers)"
"""The name under which the PSS of the session's processes that actors.json does not list is summed."""


@dataclass
class Sampler:
    """System-wide used memory and each job process's RSS / peak RSS / PSS, every SAMPLE_S seconds."""

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
    pss_at_peak: dict = field(default_factory=dict)  # process name -> PSS at peak_job_pss
    first_step_done: float | None = None  # when metrics.jsonl got its first line

    def __post_init__(self):
        self.baseline = self.peak_used = used_bytes()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop.is_set():
            used, available = used_bytes(), available_bytes()
            processes = self._processes()
            rss = {}
            for name, pid in processes.items():
                status = process_status(pid)
                if status:
                    rss[name] = status["VmRSS"]
                    self.peak_hwm[name] = max(self.peak_hwm.get(name, 0), status["VmHWM"])
            if "driver" in rss:
                self.driver_rss.append((time.time(), rss["driver"]))
            if self.first_step_done is None and _non_empty(self.run_dir / "metrics.jsonl"):
                self.first_step_done = time.time()
            if used > self.peak_used:
                self.peak_used, self.at_peak = used, rss
            self._record_pss(processes)
            if available < self.guard_bytes and not self.guard_tripped:
                self.guard_tripped = True
                self.kill()
            self._stop.wait(SAMPLE_S)

    def _record_pss(self, processes: dict[str, int]) -> None:
        by_pid = session_pss(self.driver_pid)
        total = sum(by_pid.values())
        if total <= self.peak_job_pss:
            return
        names = {pid: name for name, pid in processes.items()}
        split: dict[str, int] = {}
        for pid, pss in by_pid.items():
            name = names.get(pid, OTHER)
            split[name] = split.get(name, 0) + pss
        self.peak_job_pss, self.pss_at_peak = total, split

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


def session_pss(session: int) -> dict[int, int]:
    """pid -> bytes of PSS of every process of `session` (PSS splits shared pages fairly)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[3]) != session:  # field 6 of stat: the session id
                continue
            with open(f"/proc/{entry}/smaps_rollup") as f:
                kib = next(int(line.split()[1]) for line in f if line.startswith("Pss:"))
            found[int(entry)] = kib * 1024
        except (OSError, StopIteration, IndexError, ValueError):
            continue  # the process ended between listing and reading: it holds nothing now
    return found


def _non_empty(path: Path) -> bool:
    try:
        return path.stat().st_size > 0
    except OSError:
        return False


def meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes."""
    out = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, value = line.split(":")
            out[key] = int(value.split()[0]) * 1024
    return out


def used_bytes() -> int:
    """System-wide used memory: MemTotal - MemAvailable."""
    info = meminfo()
    return info["MemTotal"] - info["MemAvailable"]


def available_bytes() -> int:
    return meminfo()["MemAvailable"]


def process_status(pid: int) -> dict[str, int] | None:
    """{"VmRSS", "VmHWM"} of `pid` in bytes; None when it is gone."""
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
