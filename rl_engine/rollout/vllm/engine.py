"""`VllmEngine`: vLLM's CPU build as an rl_engine rollout engine, exact.

It runs `vllm.LLM` with the plugin on (`RL_ENGINE_BATCH_INVARIANT=1`: the served model is the
trainer's patched HF model, model.py) and rl_engine's sampler (sampler.py, installed through
the worker extension the caller names), and speaks the own engine's `generate` contract:
`sampling.n` completions per prompt, prompt-major, each request (prompt p, sample s) drawn
from `request_key(sampling.seed, p, s)`. So one config samples the same completions, with
the same logprobs, on either engine.

Each (prompt, sample) is its own vLLM request (n=1, its key in `extra_args`); vLLM's prefix
cache shares a group's prompt. The engine core runs in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `collective_rpc` then reaches the worker directly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch

from rl_engine.rollout import vllm as plugin
from rl_engine.rollout.completion import Completion
from rl_engine.rollout.sampling import SamplingParams, request_key
from rl_engine.rollout.vllm.sampler import KEY_ARG

ENGINE_ENV = {
    "RL_ENGINE_BATCH_INVARIANT": "1",  # the plugin: vLLM serves the trainer's patched model
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine core in this process (no spawn)
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # the process's threads stay as the job set them
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB
}
"""The environment of a process that runs VllmEngine, set before vLLM is imported."""
BLOCK_SIZE = 32  # vLLM's CPU KV cache takes multiples of 32


class VllmEngine:
    """One vLLM engine, exact, in this process. folder: an HF folder vLLM can load
    (safetensors + config.json, no quantization_config); llm_args: more `vllm.LLM` keyword
    arguments (e.g. max_num_batched_tokens), over the defaults below."""

    def __init__(
        self,
        folder: str,
        *,
        dtype: torch.dtype,
        max_batch_size: int,
        max_seq_len: int,
        worker_extension_cls: str,
        **llm_args,
    ):
        if not plugin.installed():
            raise ModuleNotFoundError(f"rollout.engine: vllm: {plugin.INSTALL_HINT}")
        unset = {k: v for k, v in ENGINE_ENV.items() if os.environ.get(k) != v}
        if unset:
            raise RuntimeError(f"VllmEngine needs this environment before vLLM loads: {unset}")
        from vllm import LLM

        args = {
            "skip_tokenizer_init": True,
            "max_num_seqs": max_batch_size,
            "max_model_len": max_seq_len,
            "block_size": BLOCK_SIZE,
            "enable_prefix_caching": True,
            **llm_args,
        }
        self.llm = LLM(
            model=str(folder),
            dtype=str(dtype).removeprefix("torch."),
            worker_extension_cls=worker_extension_cls,
            **args,
        )
        self.weight_version = 0
        self.call("rl_engine_install_sampler")

    def call(self, method: str, *args):
        """`collective_rpc` to the one worker; its result."""
        return self.llm.collective_rpc(method, args=args)[0]

    def serve_version(self, version: int) -> None:
        """New weights landed in the worker: drop vLLM's prefix cache, whose blocks hold keys
        and values of the old weights (a hit would attend over them), and serve `version`."""
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache after a weight sync")
        self.weight_version = version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        sampling: SamplingParams,
        *,
        progress: bool | None = False,
        after_env_turn: bool = False,
    ) -> list[Completion]:
        """The own engine's `generate`: `sampling.n` completions per prompt, prompt-major."""
        if after_env_turn:
            raise NotImplementedError("rollout.engine: vllm does not play multi-turn episodes")
        prompts = [[int(t) for t in ids] for ids in prompts]
        keys = [(p, s) for p in range(len(prompts)) for s in range(sampling.n)]
        requests = [{"prompt_token_ids": prompts[p]} for p, _ in keys]
        params = [_vllm_params(sampling, request_key(sampling.seed, p, s)) for p, s in keys]
        outputs = self.llm.generate(requests, params, use_tqdm=bool(progress))
        return [
            _completion(output.outputs[0], prompts[p], p, s, sampling, self.weight_version)
            for (p, s), output in zip(keys, outputs)
        ]


def _vllm_params(sampling: SamplingParams, key: int):
    """vLLM's SamplingParams for one request: stops on EOS / stop tokens as the own engine
    does (the stop token kept as the completion's last), the sampled token's logprob."""
    from vllm import SamplingParams as VllmSamplingParams

    stops = list(sampling.stop_token_ids)
    if sampling.eos_token_id is not None:
        stops.append(sampling.eos_token_id)
    return VllmSamplingParams(
        n=1,
        temperature=float(sampling.temperature),
        top_p=float(sampling.top_p),
        top_k=int(sampling.top_k),
        max_tokens=sampling.max_new_tokens,
        ignore_eos=True,  # EOS is in stop_token_ids when the sampling names one
        stop_token_ids=stops,
        logprobs=0,
        detokenize=False,
        extra_args={KEY_ARG: key},
    )


def _completion(sample, prompt_ids, p, s, sampling, version) -> Completion:
    tokens = list(sample.token_ids)
    logprobs = [step[token].logprob for token, step in zip(tokens, sample.logprobs)]
    stopped = bool(tokens) and sampling.stops_on(tokens[-1])
    return Completion(
        prompt_ids=list(prompt_ids),
        token_ids=tokens,
        logprobs=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason="stop" if stopped else "length",
        weight_version=version,
        prompt_index=p,
        sample_index=s,
        logprob_temperature=sampling.logprob_temperature,
    )
