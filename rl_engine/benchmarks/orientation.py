"""An orientation row for `rl-engine bench rollout`: llama.cpp decoding the shipped SmolLM2 GGUF.

Only when llama-cpp-python (a dev extra, not a dependency) is installed; otherwise the
benchmark prints one line saying the row is skipped. The GGUF is Q4_1, a different precision
from the engine's fp32 / bf16, so the row orients and sets no target. Batch 1, the same
thread count: after the prompt is evaluated, `new_tokens` single-token evaluations are timed
(the decode steps; no sampling).
"""

from __future__ import annotations

import importlib.util
import time

SKIPPED = "llama.cpp orientation row skipped: llama-cpp-python is not installed"


def llama_cpp_installed() -> bool:
    return importlib.util.find_spec("llama_cpp") is not None


def llama_cpp_decode_rate(prompt: list[int], new_tokens: int, threads: int) -> float:
    """Batch-1 decode tokens/s of llama.cpp on the SmolLM2 GGUF."""
    from llama_cpp import Llama

    from rl_engine.models import smollm2_gguf_path

    llm = Llama(
        model_path=str(smollm2_gguf_path()),
        n_threads=threads,
        n_ctx=len(prompt) + new_tokens + 8,
        verbose=False,
    )
    llm.eval(prompt)
    token = prompt[-1]
    start = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([token])
    return new_tokens / (time.perf_counter() - start)


def orientation_line(prompt: list[int], new_tokens: int, threads: int) -> str:
    """One line: the llama.cpp rate, or why there is none."""
    if not llama_cpp_installed():
        return SKIPPED
    rate = llama_cpp_decode_rate(prompt, new_tokens, threads)
    return (
        f"llama.cpp (llama-cpp-python), SmolLM2 GGUF Q4_1, batch 1, {threads} threads: "
        f"{rate:.1f} decode tokens/s (another precision: orientation only)"
    )
