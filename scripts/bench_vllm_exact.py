"""What exactness costs inside vLLM's CPU build: whole-call tok/s of one engine per run.

    RL_ENGINE_BATCH_INVARIANT=1 python scripts/bench_vllm_exact.py FOLDER DTYPE BATCH [--eager]

Run once with the variable (the exact model, eager), once without (vLLM's own model,
inductor-compiled by default) and once without it and with --eager. Prompts of 16-40
random ids cycled to BATCH, 32 new tokens, `logprobs=0`, `ignore_eos`; one warm-up call,
then the best of 3. Run nothing else meanwhile: the figures move with other load.
"""

from __future__ import annotations

import argparse
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("dtype", choices=("float32", "bfloat16"))
    parser.add_argument("batch", type=int)
    parser.add_argument("--eager", action="store_true", help="enforce_eager for plain vLLM")
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()

    import torch
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=args.folder,
        dtype=args.dtype,
        skip_tokenizer_init=True,
        max_num_seqs=args.batch,
        max_model_len=512,
        block_size=32,
        enforce_eager=args.eager,
        seed=0,
    )
    g = torch.Generator().manual_seed(0)
    base = [torch.randint(3, 1000, (16 + 3 * i,), generator=g).tolist() for i in range(8)]
    prompts = [{"prompt_token_ids": base[i % len(base)]} for i in range(args.batch)]
    sampling = SamplingParams(
        temperature=1.0, max_tokens=args.new_tokens, logprobs=0, detokenize=False, ignore_eos=True
    )
    llm.generate(prompts, sampling, use_tqdm=False)  # warm-up
    best = 0.0
    for _ in range(3):
        start = time.perf_counter()
        llm.generate(prompts, sampling, use_tqdm=False)
        best = max(best, args.batch * args.new_tokens / (time.perf_counter() - start))
    exact = os.environ.get("RL_ENGINE_BATCH_INVARIANT") == "1"
    mode = "exact" if exact else ("plain eager" if args.eager else "plain compiled")
    print(f"RESULT {mode} {args.dtype} batch {args.batch}: {best:.1f} tok/s")


if __name__ == "__main__":
    main()
