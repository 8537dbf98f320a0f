"""`rl-engine bench rollout --case tp`: a TP = 2 engine vs one engine, at equal total threads.

A patched Llama-shaped model (random init; hidden 1024, 16 query / 8 KV heads of 64,
MLP 2816, vocabulary 32000, fp32 or bf16) generates for 4 prompts of 128 tokens:
with `max_new_tokens = 1` (the prefill forward and one LM-head call) and with 1 + K
(K decode steps). TP = 1: one process with 2 intra-op threads (and, for reference, 1);
TP = 2: two processes (rl_engine.rollout.tp.launch) of 1 thread each. Prefill step = t(1); decode step =
(t(1 + K) - t(1)) / K; best of `repeats`. Both engines give the same tokens (checked).

Bytes sent per token per layer: counted by the TP ranks' gathers during the K decode
steps, next to the formulas of this design, (N - 1) / N * (Hq * D + I + 2 * H)
elements per rank, and of Megatron-style TP, two ring all-reduces of H elements,
2 * 2 * (N - 1) / N * H.
"""

from __future__ import annotations

import functools
import time

import torch

PROMPTS, PROMPT_LEN = 4, 128


def build(layers: int, dtype: str):
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rl_engine.patching import apply_batch_invariant

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model = model.to(getattr(torch, dtype)).eval()
    apply_batch_invariant(model)
    return model


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 32000, (PROMPT_LEN,), generator=g).tolist() for _ in range(PROMPTS)]


def measure(layers: int, dtype: str, new_tokens: int, repeats: int, tp: bool, rank=0, world=1):
    """Best prefill and decode step seconds, tokens, and (TP) bytes sent per decode token."""
    from rl_engine.rollout import RolloutEngine, SamplingParams

    model = build(layers, dtype)
    if tp:
        from rl_engine.rollout.tp import TensorParallelEngine

        engine = TensorParallelEngine(model, device="cpu", max_batch_size=PROMPTS, progress=False)
    else:
        engine = RolloutEngine(model, device="cpu", max_batch_size=PROMPTS, progress=False)
    prompts = _prompts()

    def run(n: int):
        sampling = SamplingParams(max_new_tokens=n, temperature=0.0)
        sent = engine.shards.sent_layer_bytes if tp else 0
        start = time.perf_counter()
        out = engine.generate(prompts, sampling)
        seconds = time.perf_counter() - start
        return seconds, (engine.shards.sent_layer_bytes - sent if tp else 0), out

    run(2)  # warm-up
    prefill, decode, sent_decode = [], [], 0
    for _ in range(repeats):
        t1, sent1, _ = run(1)
        tk, sentk, out = run(1 + new_tokens)
        prefill.append(t1)
        decode.append((tk - t1) / new_tokens)
        sent_decode = sentk - sent1
    per_token_layer = sent_decode / (new_tokens * PROMPTS * layers)
    return {
        "prefill": min(prefill),
        "decode": min(decode),
        "tokens": [c.token_ids for c in out],
        "sent_per_token_layer": per_token_layer,
    }


def _tp1(layers, dtype, new_tokens, repeats, threads: int = 2):
    torch.set_num_threads(threads)
    return measure(layers, dtype, new_tokens, repeats, tp=False)


def main(*, quick: bool = False, dtypes=("float32", "bfloat16")) -> str:
    from rl_engine.rollout.tp import launch

    layers, new_tokens, repeats = (2, 4, 1) if quick else (4, 16, 3)
    rows = []
    for dtype in dtypes:
        args = (layers, dtype, new_tokens, repeats)
        one = launch(lambda_free(_tp1, *args, 2), 1, threads_per_rank=2)
        single = launch(lambda_free(_tp1, *args, 1), 1, threads_per_rank=1)
        two = launch(functools.partial(measure, *args, True), 2, threads_per_rank=1)
        if not one["tokens"] == single["tokens"] == two["tokens"]:
            raise RuntimeError("TP = 2 and TP = 1 sampled different tokens")
        rows.append(
            f"| {dtype} | {single['prefill'] * 1e3:.0f} | {one['prefill'] * 1e3:.0f} | "
            f"{two['prefill'] * 1e3:.0f} | {two['prefill'] / one['prefill']:.2f}x | "
            f"{single['decode'] * 1e3:.1f} | {one['decode'] * 1e3:.1f} | "
            f"{two['decode'] * 1e3:.1f} | {two['decode'] / one['decode']:.2f}x | "
            f"{two['sent_per_token_layer']:.0f} |"
        )
        print(rows[-1], flush=True)
    itemsize = {"float32": 4, "bfloat16": 2}
    traffic = [
        f"| {dtype} | {ours(1024, 16 * 64, 2816, 2) * itemsize[dtype]:.0f} | "
        f"{megatron(1024, 2) * itemsize[dtype]:.0f} |"
        for dtype in dtypes
    ]
    table = "\n".join(
        [
            f"{layers} layers, {PROMPTS} prompts x {PROMPT_LEN} tokens, {new_tokens} decode steps, "
            f"best of {repeats}; 2 threads in all",
            "",
            "| dtype | prefill TP=1 1 thread ms | prefill TP=1 2 threads ms | prefill TP=2 "
            "(2 x 1 thread) ms | TP2 / TP1 2 threads | decode step TP=1 1 thread ms | decode step "
            "TP=1 2 threads ms | decode step TP=2 ms | TP2 / TP1 2 threads | bytes sent / token / "
            "layer / rank (measured) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
            *rows,
            "",
            "| dtype | this design, formula (bytes / token / layer / rank) | Megatron-style TP |",
            "|---|---:|---:|",
            *traffic,
        ]
    )
    print(table)
    return table


def ours(hidden: int, q_width: int, intermediate: int, world: int) -> float:
    """Elements one rank sends per token per layer: all-gathers of the attention output, the
    o_proj output, the MLP width and the down_proj output (each 1/N of it to N - 1 ranks)."""
    return (world - 1) / world * (q_width + intermediate + 2 * hidden)


def megatron(hidden: int, world: int) -> float:
    """Elements one rank sends per token per layer in Megatron-style TP: two ring all-reduces
    (after attention, after the MLP) of H elements, 2 (N - 1) / N * H each."""
    return 2 * 2 * (world - 1) / world * hidden


def lambda_free(fn, *args):
    """A picklable `fn(*args)` for launch (which calls it with rank and world)."""
    return functools.partial(_drop_rank, fn, args)


def _drop_rank(fn, args, rank: int, world: int):
    return fn(*args)


if __name__ == "__main__":
    main()
