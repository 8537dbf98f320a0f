"""rl_engine's vLLM engine (`VllmEngine`: the plugin's model and sampler), run by the
session's exact engine host (tests/helpers/rollout/vllm/engine_host.py), whose environment is
`VllmEngine`'s (ENGINE_ENV): `run(SPEC) -> OUT`.

SPEC: {"folder", "dtype", "llm": {more LLM keyword arguments}, "prompts": [[ids]],
"samplings": {name: {SamplingParams fields}}, "max_batch_size"}.
OUT: {"exact": {name: [[token_ids, logprobs, finish_reason, prompt_index, sample_index]]},
"vllm_sampler": {name: [[token_ids]]}}: the second runs the same requests after vLLM's own
`Sampler` is put back (the engine's seed, no per-request one: vLLM 0.32's CPU build dies on
a seeded request with chunked prefill): the negative control of the sampler.
"""

from __future__ import annotations

WORKER_EXTENSION = "rl_engine.executors.job.actors.vllm_worker.ExactWorkerExtension"


def _vllm_sampler(worker) -> None:
    from vllm.v1.sample.sampler import Sampler

    worker.model_runner.sampler = Sampler()


def run(spec: dict) -> dict:
    import torch
    from vllm import SamplingParams as VllmSamplingParams

    from rl_engine.rollout.sampling import SamplingParams
    from rl_engine.rollout.vllm.engine import VllmEngine
    from tests.helpers.rollout.vllm.engine_run import free_engines

    engine = VllmEngine(
        spec["folder"],
        dtype=getattr(torch, spec["dtype"]),
        max_batch_size=spec["max_batch_size"],
        max_seq_len=512,
        worker_extension_cls=WORKER_EXTENSION,
        **spec["llm"],
    )
    samplings = {name: SamplingParams(**fields) for name, fields in spec["samplings"].items()}
    exact = {}
    for name, sampling in samplings.items():
        completions = engine.generate(spec["prompts"], sampling)
        exact[name] = [
            [c.token_ids, c.logprobs.tolist(), c.finish_reason, c.prompt_index, c.sample_index]
            for c in completions
        ]
    engine.llm.collective_rpc(_vllm_sampler)
    plain = {}
    for name, sampling in samplings.items():
        params = VllmSamplingParams(
            n=sampling.n,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,
            max_tokens=sampling.max_new_tokens,
            ignore_eos=True,
            detokenize=False,
        )
        outputs = engine.llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], params)
        plain[name] = [[list(o.token_ids)] for output in outputs for o in output.outputs]
    engine.llm.llm_engine.engine_core.shutdown()
    del engine
    free_engines()
    return {"exact": exact, "vllm_sampler": plain}
