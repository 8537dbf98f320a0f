"""vLLM engines in one process, one after another:
`python -m tests.helpers.rollout.vllm.engine_run SPEC.json OUT.json`.

SPEC: {"runs": [{"folder", "dtype", "llm": {LLM keyword arguments}, "prompts": [[ids]],
"max_tokens"}]}. OUT: {"runs": [{"completions": [{"token_ids", "logprobs", "cached_tokens"}]}]},
each logprob the sampled token's (`SamplingParams(logprobs=0)`, temperature 1.0);
cached_tokens: the prompt tokens vLLM's prefix cache served. Each run is a fresh `LLM`,
closed before the next starts: importing vLLM (the larger part of a start) is paid once.
The caller sets the process's environment (RL_ENGINE_BATCH_INVARIANT), exactly as a user
starting vLLM would.
"""

from __future__ import annotations

import json
import os
import sys


def sample(run: dict) -> list[dict]:
    """One engine: start it, sample every prompt, close it (its KV cache and process group)."""
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

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
    cleanup_dist_env_and_memory()
    return completions


def main(spec_path: str, out_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    runs = [{"completions": sample(run)} for run in spec["runs"]]
    temporary = f"{out_path}.tmp"
    with open(temporary, "w") as f:
        json.dump({"runs": runs}, f)
    os.replace(temporary, out_path)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
