"""One vLLM engine of `rl-engine bench rollout --engine vllm`, alone in its own process:

    python -m rl_engine.benchmarks.vllm_engine SPEC.json

SPEC: {"folder", "dtype", "batches": [B, ...], "prompts": [[ids], ...] (cycled to each B),
"new_tokens", "repeats", "llm": {LLM keyword arguments}}. The caller sets the environment
(RL_ENGINE_BATCH_INVARIANT, the VLLM_CPU_* thread and KV-cache variables), as a user starting
vLLM would. Prints one `MODE {json}` line (the compilation vLLM chose), then one
`RESULT {json}` line per batch: whole-call tokens/s (batch x new tokens over the call's
time), best of `repeats` calls after one warm-up call.
"""

from __future__ import annotations

import json
import sys
import time

MODE = "MODE "
RESULT = "RESULT "


def cycled(prompts: list[list[int]], batch: int) -> list[dict]:
    return [{"prompt_token_ids": prompts[i % len(prompts)]} for i in range(batch)]


def best_rate(llm, prompts: list[dict], sampling, new_tokens: int, repeats: int) -> float:
    """Whole-call tokens/s of `llm.generate`, best of `repeats` after one warm-up call."""
    llm.generate(prompts, sampling, use_tqdm=False)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, sampling, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
    made = {len(output.outputs[0].token_ids) for output in outputs}
    if made != {new_tokens}:  # ignore_eos: every request must run to max_tokens
        raise RuntimeError(f"vLLM generated {sorted(made)} tokens per request, not {new_tokens}")
    return len(prompts) * new_tokens / best


def compilation(llm) -> dict:
    config = llm.llm_engine.vllm_config
    return {
        "compilation_mode": config.compilation_config.mode.name,
        "backend": config.compilation_config.backend,
        "enforce_eager": config.model_config.enforce_eager,
    }


def main(spec_path: str) -> None:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(model=spec["folder"], dtype=spec["dtype"], skip_tokenizer_init=True, **spec["llm"])
    print(MODE + json.dumps(compilation(llm)), flush=True)
    sampling = SamplingParams(
        temperature=1.0,
        max_tokens=spec["new_tokens"],
        logprobs=0,
        detokenize=False,
        ignore_eos=True,
    )
    for batch in spec["batches"]:
        prompts = cycled(spec["prompts"], batch)
        rate = best_rate(llm, prompts, sampling, spec["new_tokens"], spec["repeats"])
        print(RESULT + json.dumps({"batch": batch, "tokens_per_second": rate}), flush=True)


if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports __main__
    main(sys.argv[1])
