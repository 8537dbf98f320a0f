"""One vLLM engine in its own process: `python -m tests.helpers.rollout.vllm.engine_run SPEC.json OUT.json`.

SPEC: {"folder", "dtype", "llm": {LLM keyword arguments}, "prompts": [[ids]], "max_tokens"}.
OUT: {"completions": [{"token_ids", "logprobs", "cached_tokens"}]}, each logprob the sampled
token's (`SamplingParams(logprobs=0)`, temperature 1.0); cached_tokens: the prompt tokens
vLLM's prefix cache served. The caller sets the process's
environment (RL_ENGINE_BATCH_INVARIANT), exactly as a user starting vLLM would.
"""

from __future__ import annotations

import json
import sys


def main(spec_path: str, out_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(model=spec["folder"], dtype=spec["dtype"], skip_tokenizer_init=True, **spec["llm"])
    sampling = SamplingParams(
        temperature=1.0,
        max_tokens=spec["max_tokens"],
        logprobs=0,
        detokenize=False,
        ignore_eos=True,
    )
    outputs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], sampling)
    completions = []
    for output in outputs:
        sample = output.outputs[0]
        logprobs = [step[token].logprob for token, step in zip(sample.token_ids, sample.logprobs)]
        completions.append(
            {
                "token_ids": list(sample.token_ids),
                "logprobs": logprobs,
                "cached_tokens": output.num_cached_tokens or 0,
            }
        )
    with open(out_path, "w") as f:
        json.dump({"completions": completions}, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
