"""`rl-engine bench rollout --engine vllm`: vLLM with rl_engine's plugin vs plain vLLM vs the
own rollout engine, whole-call tokens/s on the same prompts and threads, beside the roofline.

On SmolLM2-135M-Instruct (the packaged GGUF written as a Hugging Face folder, which vLLM
loads), for each dtype, one engine at a time on the machine (one after another):
  plugin: vLLM with RL_ENGINE_BATCH_INVARIANT=1 (rl_engine's exact model inside vLLM, run
          eager: docs/rollouts.md, "vLLM, exact"), in a process of its own;
  plain:  vLLM without the variable (its own model code, its default compilation), in a
          process of its own (the variable is read per process);
  own:    RolloutEngine on the patched model (batch_invariant=true), in this process,
          first (its model is freed before vLLM starts).
Each engine runs every batch size: the bench's 8 chat prompts cycled to the batch, N new
tokens (no EOS stop), sampling at T = 1 with the sampled tokens' logprobs; whole-call
tokens/s = batch x N / time of the call (prefill included), best of `--repeats` calls after
one warm-up call. vLLM runs on cores 0..T-1 (VLLM_CPU_OMP_THREADS_BIND), the own engine on T
torch intra-op threads (not pinned). vLLM's prefix cache is off: the timed calls repeat the
warm-up's prompts, and a cache would skip their prefill, which the own engine redoes.

Beside each row, the limit of the own engine's decode step (roofline.py: bytes over a copy
probe's bandwidth, FLOPs over the cpp GEMM's peak; the best probe counts) and the row's
fraction of it. A whole-call rate includes the prefill, so its fraction is a floor.
Without vLLM installed, the vLLM rows are skipped with one line.

    rl-engine bench rollout --engine vllm   (or: python -m rl_engine.benchmarks.rollout_vllm --help)
"""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from rl_engine.benchmarks.args import bench_parser
from rl_engine.benchmarks.rollout import QUESTIONS, encode_prompts, random_prompts
from rl_engine.benchmarks.roofline import ModelShape, Roofline, copy_bandwidth, decode_roofline
from rl_engine.benchmarks.timing import child_env, intra_op_threads
from rl_engine.benchmarks.vllm_engine import MODE, RESULT
from rl_engine.models import SMOLLM2_NAME, TINY_CONFIGS, load_model
from rl_engine.patching import apply_batch_invariant
from rl_engine.rollout import RolloutEngine, SamplingParams
from rl_engine.rollout.vllm import ENV_VAR
from rl_engine.rollout.vllm.folders import write_folder, write_smollm2_folder

REPO = Path(__file__).resolve().parents[2]
ENGINE_MODULE = "rl_engine.benchmarks.vllm_engine"
SKIPPED = (
    "vLLM rows skipped: vllm is not installed in this interpreter "
    "(docs/rollouts.md, 'vLLM, exact', says how)"
)
LABELS = {"plugin": "vLLM + rl_engine plugin", "plain": "plain vLLM", "own": "rl_engine (patched)"}
LOG_TAIL = 80  # lines of a failed engine's output kept for the error


@dataclasses.dataclass(frozen=True)
class Setup:
    model: str
    dtypes: tuple[str, ...]
    batches: tuple[int, ...]
    new_tokens: int
    repeats: int
    threads: int


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def write_model_folder(spec: str, dtype: torch.dtype, root: Path) -> Path:
    """`spec` as a Hugging Face folder vLLM loads."""
    if spec == SMOLLM2_NAME:
        return write_smollm2_folder(dtype, root)
    if spec in TINY_CONFIGS:
        return write_folder(spec, dtype, root)
    raise ValueError(f"--model {spec!r}: the vLLM bench takes {SMOLLM2_NAME} or a tiny model name")


def base_prompts(folder: Path) -> list[list[int]]:
    """The bench's 8 prompts: chat-formatted QUESTIONS, or random ids for a tiny model."""
    model, tokenizer = load_model(folder, dtype=torch.float32)
    if tokenizer is None:
        return random_prompts(model.config.vocab_size, len(QUESTIONS))
    return encode_prompts(tokenizer, len(QUESTIONS))


def cycled(prompts: list[list[int]], batch: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(batch)]


def thread_bind(threads: int) -> str:
    """VLLM_CPU_OMP_THREADS_BIND for cores 0..threads-1."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def engine_env(exact: bool, threads: int) -> dict[str, str]:
    """A vLLM process's environment: the plugin on or off, the settings the bench needs."""
    env = child_env(
        VLLM_CPU_OMP_THREADS_BIND=thread_bind(threads),
        VLLM_CPU_NUM_OF_RESERVED_CPU="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        OMP_NUM_THREADS=str(threads),
    )
    env.pop(ENV_VAR, None)
    if exact:
        env[ENV_VAR] = "1"
    # the plugin's entry point imports rl_engine: this tree, whatever is installed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    return env


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def vllm_rates(
    kind: str, folder: Path, dtype: str, setup: Setup, prompts: list[list[int]]
) -> tuple[str, dict[int, float]]:
    """(mode, {batch: whole-call tok/s}) of one vLLM engine (`kind` plugin or plain), run in
    its own process; a progress line per batch as it ends."""
    spec = {
        "folder": str(folder),
        "dtype": dtype,
        "batches": list(setup.batches),
        "prompts": prompts,
        "new_tokens": setup.new_tokens,
        "repeats": setup.repeats,
        "llm": {
            "max_num_seqs": max(setup.batches),
            "max_model_len": 512,
            "block_size": 32,  # the CPU KV cache takes multiples of 32
            "enable_prefix_caching": False,
            "seed": 0,
        },
    }
    spec_path = folder.parent / f"{kind}-{dtype}.json"
    write_json(spec_path, spec)
    print(f"  {LABELS[kind]} {dtype}: starting the engine", flush=True)
    command = [sys.executable, "-m", ENGINE_MODULE, str(spec_path)]
    env = engine_env(kind == "plugin", setup.threads)
    mode, rates, tail = None, {}, collections.deque(maxlen=LOG_TAIL)
    with subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        for line in proc.stdout:
            if line.startswith(MODE):
                mode = mode_of(kind, json.loads(line.removeprefix(MODE)))
            elif line.startswith(RESULT):
                result = json.loads(line.removeprefix(RESULT))
                rates[result["batch"]] = result["tokens_per_second"]
                progress(kind, dtype, result["batch"], result["tokens_per_second"])
            else:
                tail.append(line)
    if proc.returncode != 0 or mode is None or set(rates) != set(setup.batches):
        raise RuntimeError(
            f"{LABELS[kind]} engine ({dtype}, {folder}) failed (rc {proc.returncode}); "
            f"its last output:\n{''.join(tail)}"
        )
    return mode, rates


def mode_of(kind: str, compilation: dict) -> str:
    """How a vLLM engine ran its model: the plugin's ExactCausalLM is never compiled."""
    if kind == "plugin":
        return "eager (ExactCausalLM is not compiled)"
    if compilation["enforce_eager"]:
        return "eager"
    return f"vLLM default: {compilation['compilation_mode']}, {compilation['backend']}"


def progress(kind: str, dtype: str, batch: int, rate: float) -> None:
    print(f"  {LABELS[kind]} {dtype} batch {batch}: {rate:.1f} tok/s", flush=True)


def own_rates(
    folder: Path, dtype: str, setup: Setup, prompts: list[list[int]], probes: list[float]
) -> tuple[dict[int, float], dict[int, Roofline]]:
    """({batch: whole-call tok/s}, {batch: decode-step limit}) of RolloutEngine on the
    patched model; each batch's bandwidth probe joins `probes`."""
    model, _ = load_model(folder, dtype=getattr(torch, dtype))
    apply_batch_invariant(model)
    shape = ModelShape.of(model, patched=True)
    rates, roofs = {}, {}
    with intra_op_threads(setup.threads):
        for batch in setup.batches:
            batch_prompts = cycled(prompts, batch)
            rates[batch] = engine_rate(model, batch_prompts, setup)
            progress("own", dtype, batch, rates[batch])
            probes.append(copy_bandwidth(setup_copy_mib(setup)))
            # mean context of the decode steps (the 2nd to the Nth token)
            context = sum(map(len, batch_prompts)) / batch + setup.new_tokens / 2
            roofs[batch] = decode_roofline(shape, batch, context, model.dtype, max(probes))
    return rates, roofs


def setup_copy_mib(setup: Setup) -> int:
    """The copy probe's size: far larger than the caches, small for a tiny smoke run."""
    return 16 if setup.model in TINY_CONFIGS else 512


def engine_rate(model, prompts: list[list[int]], setup: Setup) -> float:
    """Whole-call tok/s of RolloutEngine.generate, best of `repeats` after one warm-up call."""
    engine = RolloutEngine(model, device="cpu", max_batch_size=len(prompts), progress=False)
    sampling = SamplingParams(max_new_tokens=setup.new_tokens, temperature=1.0, seed=0)
    engine.generate(prompts, sampling)
    best = float("inf")
    for _ in range(setup.repeats):
        start = time.perf_counter()
        completions = engine.generate(prompts, sampling)
        best = min(best, time.perf_counter() - start)
    made = {len(c.token_ids) for c in completions}
    if made != {setup.new_tokens}:
        raise RuntimeError(f"the engine generated {sorted(made)} tokens, not {setup.new_tokens}")
    return len(prompts) * setup.new_tokens / best


def bench_dtype(dtype: str, setup: Setup, root: Path, probes: list[float]) -> list[dict]:
    """The rows of one dtype: the vLLM engines (when installed), then the own engine."""
    folder = write_model_folder(setup.model, getattr(torch, dtype), root)
    prompts = base_prompts(folder)
    # the own engine first: it builds the C++ kernels here if needed, not in a vLLM worker
    # pinned to the bench's cores (the plugin runs the same kernels); its model is freed after
    rates, roofs = own_rates(folder, dtype, setup, prompts, probes)
    own = (f"batch_invariant, torch threads {setup.threads}", rates)
    results = {}  # kind -> (mode, {batch: rate}), in the table's order
    if vllm_installed():
        for kind in ("plugin", "plain"):
            results[kind] = vllm_rates(kind, folder, dtype, setup, prompts)
    results["own"] = own
    return [
        {"dtype": dtype, "batch": batch, "kind": kind, "mode": mode, "rate": by_batch[batch]}
        | {
            "roof": roofs[batch],
            "plain": results["plain"][1][batch] if "plain" in results else None,
        }
        for batch in setup.batches
        for kind, (mode, by_batch) in results.items()
    ]


def markdown_table(rows: list[dict], bandwidth: float) -> str:
    """One row per engine, dtype and batch; each limit at the best bandwidth probe."""
    with_plain = all(r["plain"] is not None for r in rows)
    ratio = " / plain vLLM |" if with_plain else ""
    lines = [
        "| dtype | batch | engine | mode | whole-call tok/s |"
        + ratio
        + " MB / step | copy GB/s | GFLOP / step | GEMM GFLOP/s | limit tok/s | bound "
        "| fraction of limit |",
        "|---|---:|---|---|---:|" + "---:|" * with_plain + "---:|---:|---:|---:|---:|---|---:|",
    ]
    for r in rows:
        roof = dataclasses.replace(r["roof"], bandwidth=bandwidth)
        cells = [r["dtype"], str(r["batch"]), LABELS[r["kind"]], r["mode"], f"{r['rate']:.1f}"]
        if with_plain:
            cells.append(f"{r['rate'] / r['plain']:.2f}x")
        cells += [
            f"{roof.step_bytes / 1e6:.4g}",
            f"{roof.bandwidth:.1f}",
            f"{roof.step_flops / 1e9:.4g}",
            f"{roof.peak:.1f}",
            f"{roof.tokens_per_second:.1f}",
            roof.bound,
            f"{roof.fraction(r['rate']):.2g}",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def header(setup: Setup) -> str:
    return (
        f"{setup.model}, {setup.new_tokens} new tokens, batch {list(setup.batches)}, whole-call "
        f"tok/s (prefill included), best of {setup.repeats} after a warm-up; vLLM on cores "
        f"{thread_bind(setup.threads)}, the own engine on torch threads {setup.threads}. Modes: "
        f"{LABELS['plugin']} = RL_ENGINE_BATCH_INVARIANT=1, eager; {LABELS['plain']} = vLLM's "
        "default compilation; limit = the own engine's decode step (roofline.py); every engine "
        f"under OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}; the prompts "
        "repeat past 8: the own engine prefills a repeated prompt once per call "
        "(share_prompt_prefill), vLLM's prefix cache is off (it would also serve the timed "
        "calls that repeat the warm-up's prompts)"
    )


def parse_setup(argv: list[str] | None) -> Setup:
    parser = bench_parser(__doc__, quick="bfloat16 only, batch 1 and 8")
    parser.add_argument("--model", default=SMOLLM2_NAME, help=f"{SMOLLM2_NAME} or a tiny model")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument(
        "--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"]
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="cores 0..N-1 / torch threads")
    args = parser.parse_args(argv)
    if args.quick:
        args.dtype, args.batch = ["bfloat16"], [1, 8]
    if args.tiny:
        args.model, args.new_tokens, args.batch, args.repeats, args.threads = (
            "tiny-llama",
            4,
            [1, 8],
            1,
            1,
        )
    for name, value in (("--new-tokens", args.new_tokens), ("--repeats", args.repeats)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if args.threads < 1 or args.threads > os.cpu_count():
        raise ValueError(f"--threads must be 1..{os.cpu_count()} (cores here), got {args.threads}")
    if min(args.batch) < 1:
        raise ValueError(f"--batch sizes must be >= 1, got {args.batch}")
    return Setup(
        args.model,
        tuple(args.dtype),
        tuple(args.batch),
        args.new_tokens,
        args.repeats,
        args.threads,
    )


def main(argv: list[str] | None = None) -> str:
    setup = parse_setup(argv)
    logging.basicConfig(level=logging.WARNING)
    print(header(setup), flush=True)
    if not vllm_installed():
        print(SKIPPED, flush=True)
    rows, probes = [], []
    with tempfile.TemporaryDirectory(prefix="bench-vllm-") as root:
        for dtype in setup.dtypes:
            rows += bench_dtype(dtype, setup, Path(root), probes)
    listed = ", ".join(f"{v:.1f}" for v in probes)
    print(f"  copy bandwidth probes: {listed} GB/s (best counts)", flush=True)
    table = markdown_table(rows, max(probes))
    print()
    print(table)
    for line in verdict_lines(rows):
        print(line)
    return table


PLUGIN_COST_TARGET = 1.25  # the plugin may take at most this many times plain vLLM's time


def verdict_lines(rows: list[dict]) -> list[str]:
    """Per dtype and batch, against plain vLLM's rate: the plugin's cost (target: at most
    PLUGIN_COST_TARGET x plain vLLM's time) and the own engine's lead, or by how much it
    falls short. Nothing without plain vLLM's rows."""
    lines = []
    for r in rows:
        if r["plain"] is None or r["kind"] == "plain":
            continue
        ratio = r["rate"] / r["plain"]
        where = f"{r['dtype']} batch {r['batch']}"
        if r["kind"] == "plugin":
            verdict = "met" if 1 / ratio <= PLUGIN_COST_TARGET else "MISSED"
            lines.append(
                f"  plugin {where}: costs {1 / ratio:.2f}x plain vLLM's time "
                f"(target <= {PLUGIN_COST_TARGET}x): {verdict}"
            )
        elif ratio >= 1:
            lines.append(f"  own engine {where}: {ratio:.3f}x plain vLLM's tok/s: ahead")
        else:
            lines.append(
                f"  own engine {where}: {ratio:.3f}x plain vLLM's tok/s: short by "
                f"{(1 - ratio) * 100:.1f}%"
            )
    return lines


if __name__ == "__main__":  # vLLM's engine core is spawned by the child, not here
    main()
