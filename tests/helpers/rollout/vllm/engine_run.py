"""vLLM engines one after another, in the session's engine host (`run_all`, through
tests/helpers/rollout/vllm/engine_host.py) or in a process of their own:
`python -m tests.helpers.rollout.vllm.engine_run SPEC.json OUT.json` (an engine that must
refuse to start).

SPEC: {"runs": [{"folder", "dtype", "llm": {LLM keyword arguments}, "prompts": [[ids]],
"max_tokens"}]}. OUT: {"runs": [{"completions": [{"token_ids", "logprobs", "cached_tokens"}]}]},
each logprob the sampled token's (`SamplingParams(logprobs=0)`, temperature 1.0);
cached_tokens: the prompt tokens vLLM's prefix cache served. Each run is a fresh `LLM`,
closed before the next starts. The caller sets the process's environment
(RL_ENGINE_BATCH_INVARIANT), exactly as a user starting vLLM would.
"""

from __future__ import annotations

import gc
import json
import os
import sys


def sample(run: dict) -> list[dict]:
    """One engine: start it, sample every prompt, close it (its KV cache and process group)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=run["folder"], dtype=run["dtype"], skip_tokenizer_init=True, **run["llm"])
    sampling = SamplingParams(
        temperature=1.0,
        max_tokens=run["max_tokens"],
        logprobs=0,
        detokenize=False,
        ignore_eos=True,
    )
    prompts = [{"prompt_token_ids": p} for p in run["prompts"]]
    outputs = llm.generate(prompts, sampling, use_tqdm=False)
    completions = []
    for output in outputs:
        sampled = output.outputs[0]
        logprobs = [step[token].logprob for token, step in zip(sampled.token_ids, sampled.logprobs)]
        completions.append(
            {
                "token_ids": list(sampled.token_ids),
                "logprobs": logprobs,
                "cached_tokens": output.num_cached_tokens or 0,
            }
        )
    llm.llm_engine.engine_core.shutdown()
    del llm
    free_engines()
    return completions


def free_engines() -> None:
    """Once the last reference to a shut-down engine is gone: free its KV cache and process
    group, so that the next engine of this process starts as in a fresh one. Then freeze the
    heap that is left (torch's, transformers' and vLLM's long-lived objects): vLLM runs full
    collections as it loads a model and shuts an engine down, and they need not scan it again
    (measured on a warm host, a tiny engine: 3.2 s, 2.4 s of it gc, to 1.8 s). The bits do
    not depend on it, only how often the collector walks the heap."""
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    cleanup_dist_env_and_memory()
    gc.freeze()


def run_all(spec: dict) -> dict:
    """SPEC's engines in turn: OUT."""
    return {"runs": [{"completions": sample(run)} for run in spec["runs"]]}


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        runs = run_all(json.load(f))["runs"]
    temporary = f"{out_path}.tmp"
    with open(temporary, "w") as f:
        json.dump({"runs": runs}, f)
    os.replace(temporary, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
