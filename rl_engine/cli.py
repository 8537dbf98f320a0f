"""`rl-engine train | export | diagnose | bench | models` — the command-line entry point.

Errors in what the user gave (config, flags, run directory) are one line on stderr and
exit code 2; a job stopped by a failed actor exits 1, by Ctrl-C 130, by SIGTERM 143.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys


def use_venv_op_cache() -> None:
    """Keep DeepSpeed's JIT op cache inside this environment (its default, keyed by op name only,
    makes two checkouts rebuild each other's op); `make setup` builds the op there."""
    from pathlib import Path

    os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _load_config(path: str, overrides: list[str] = ()):
    from rl_engine.config import RunConfig

    return RunConfig.from_yaml(path, overrides)


def cmd_train(args) -> int:
    from rl_engine.executors.job.cluster import ClusterError
    from rl_engine.executors.job.faults import JobStopped
    from rl_engine.executors.job.ray_job import run_job
    from rl_engine.executors.job.run_dir import resume_config

    if args.resume is not None:
        config = resume_config(args.resume, args.config, args.set)
    elif args.config is None:
        raise ValueError("train needs --config FILE (or --resume RUN_DIR)")
    else:
        config = _load_config(args.config, args.set)
    try:
        history = run_job(config, resume=args.resume is not None, overwrite=args.overwrite)
    except JobStopped as stopped:
        print(f"rl-engine: {stopped}", file=sys.stderr)
        return stopped.exit_code
    except ClusterError as err:  # the cluster, not the config: placement or mixed hardware
        logging.getLogger("rl_engine").error("%s", _one_line(err))
        return 1
    last = history[-1] if history else {}
    print(
        f"done: {len(history)} steps, outputs in {config.output_dir}; last parity exact-match "
        f"{last.get('parity/exact_match_fraction', float('nan')):.4f}"
    )
    return 0


def cmd_export(args) -> int:
    from rl_engine.executors.job.export import export_checkpoint

    path = export_checkpoint(args.run_dir, args.to, args.step, merged=args.merged)
    if (path / "adapter_config.json").is_file():
        print(f"exported to {path} (load with PeftModel.from_pretrained(base, DIR))")
    else:
        print(f"exported to {path} (load with AutoModelForCausalLM.from_pretrained)")
    return 0


def cmd_diagnose(args) -> int:
    if args.rollouts is not None:
        return cmd_diagnose_rollouts(args)
    from rl_engine.diagnostics.report import run_diagnosis

    report = run_diagnosis(_load_config(args.config), output_dir=args.output_dir)
    print(report.markdown())
    return 0


def cmd_diagnose_rollouts(args) -> int:
    """0: every token exact with invariance on; 1: not; 2 (from main): unusable input."""
    from rl_engine.diagnostics.rollout_file import diagnose_rollouts

    report = diagnose_rollouts(
        args.rollouts,
        args.model,
        dtype=args.dtype,
        output_dir=args.output_dir or "runs/diagnose_rollouts",
        skip_bad_lines=args.skip_bad_lines,
        adapter=args.adapter,
    )
    print(report.markdown())
    return 0 if report.exact else 1


def _check_diagnose_args(parser: argparse.ArgumentParser, args) -> None:
    if args.command != "diagnose":
        return
    if args.rollouts is not None and args.model is None:
        parser.error("diagnose --rollouts needs --model SPEC")
    if args.rollouts is None and (args.model, args.dtype, args.skip_bad_lines) != (
        None,
        None,
        False,
    ):
        parser.error("--model, --dtype and --skip-bad-lines go with diagnose --rollouts")
    if args.rollouts is None and args.adapter is not None:
        parser.error("--adapter goes with diagnose --rollouts (with --config: the adapter: key)")
    args.dtype = args.dtype or "float32"


# `rl-engine bench WHAT [--case CASE]` -> the modules of rl_engine.benchmarks that run it, in
# order (None: WHAT without --case). Each module's `main(argv)` takes --quick and --tiny and
# prints its table. tests/test_layering.py checks that every benchmark module is reachable here.
BENCH_CASES: dict[str, dict[str | None, tuple[str, ...]]] = {
    "kernels": {
        None: ("kernels",),
        "gemm": ("gemm",),
        "decode-gemm": ("decode_gemm",),
        "native-linear": ("native_linear",),
        "attention": ("attention_cpp",),
    },
    "rollout": {
        None: ("rollout",),
        "decode": ("rollout",),
        "prefill": ("prefill",),
        "tp": ("tensor_parallel",),
        "tail": ("speculative",),
    },
    "train": {
        None: ("train_step", "packing"),
        "invariance": ("train_step",),
        "packing": ("packing",),
        "mini-batches": ("mini_batches",),
        "layout": ("layout_train",),
    },
    "moe": {None: ("moe",)},
    "job": {None: ("real_size",), "real-size": ("real_size",), "async": ("async_job",)},
}
# `--device cuda`: the Triton backend vs cuBLAS / SDPA (every other benchmark runs on the CPU)
BENCH_CASES_CUDA: dict[str, dict[str | None, tuple[str, ...]]] = {
    "kernels": {None: ("gpu_kernels",)},
}
# `--engine vllm`: vLLM with rl_engine's plugin vs plain vLLM vs the own engine (CPU)
BENCH_CASES_VLLM: dict[str, dict[str | None, tuple[str, ...]]] = {
    "rollout": {None: ("rollout_vllm",), "decode": ("rollout_vllm",)},
}


def _bench_table(device: str, engine: str = "own") -> dict[str, dict[str | None, tuple[str, ...]]]:
    if engine == "vllm":
        return BENCH_CASES_VLLM
    return BENCH_CASES_CUDA if device == "cuda" else BENCH_CASES


def _check_bench_args(parser: argparse.ArgumentParser, args) -> None:
    if args.command != "bench":
        return
    if args.engine == "vllm" and args.device != "cpu":
        parser.error(f"bench --engine vllm --device {args.device}: vLLM's CPU build runs on cpu")
    table = _bench_table(args.device, args.engine)
    where = " --device cuda" if args.device == "cuda" else ""
    where += " --engine vllm" if args.engine == "vllm" else ""
    if args.what not in table:
        runs_there = " and ".join(f"bench {what}" for what in table)
        parser.error(f"bench {args.what}{where}: only {runs_there} runs there")
    if args.case not in table[args.what]:
        valid = ", ".join(case for case in table[args.what] if case is not None) or "none"
        parser.error(f"bench {args.what}{where} --case {args.case}: valid cases are {valid}")


def cmd_bench(args) -> int:
    import importlib

    flags = ["--quick"] * args.quick + ["--tiny"] * args.tiny
    for name in _bench_table(args.device, args.engine)[args.what][args.case]:
        status = importlib.import_module(f"rl_engine.benchmarks.{name}").main(flags)
        if isinstance(status, int) and status != 0:  # the job benchmark: a run failed
            return status
    return 0


def cmd_models(args) -> int:
    from rl_engine.models import quiet_loading, warm_model_cache
    from rl_engine.models.gguf_cache import CACHE_ENV, cache_root

    if cache_root() is None:  # `make test` runs this first: a turned-off cache is not an error
        print(f"{CACHE_ENV}=off: the model cache is off, nothing to warm")
        return 0
    quiet_loading()
    for spec in args.spec:
        print(f"{spec}: {warm_model_cache(spec)}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl-engine", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run an RL job (Ray + DeepSpeed) from a YAML config")
    train.add_argument("--config", help="run config, e.g. configs/demo.yaml")
    train.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted, e.g. trainer.lr=1e-5; the value is read as YAML)",
    )
    train.add_argument(
        "--resume", metavar="RUN_DIR", help="continue that run from its latest checkpoint"
    )
    train.add_argument(
        "--overwrite", action="store_true", help="replace an existing run in output_dir"
    )
    train.set_defaults(fn=cmd_train)
    export = sub.add_parser("export", help="a run's checkpoint as a Hugging Face model folder")
    export.add_argument("run_dir", metavar="RUN_DIR")
    export.add_argument("--to", required=True, metavar="DIR", help="new folder to write")
    export.add_argument(
        "--step", type=int, default=None, help="checkpoint after N steps (default: latest)"
    )
    export.add_argument(
        "--merged",
        action="store_true",
        help="a LoRA run: a full HF folder with the adapters folded in (default: a PEFT adapter folder)",
    )
    export.set_defaults(fn=cmd_export)
    diag = sub.add_parser(
        "diagnose",
        help="rollout vs. trainer logprob mismatch, invariance on and off "
        "(--rollouts exits 0 when exact with invariance on, 1 when not, 2 for unusable input)",
    )
    source = diag.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="run config, e.g. configs/diagnose_tiny.yaml")
    source.add_argument(
        "--rollouts", help="rollout file (JSONL, docs/rollouts.md) of any engine to diagnose"
    )
    diag.add_argument("--model", help="with --rollouts: the model spec that sampled them")
    diag.add_argument(
        "--dtype", choices=["float32", "bfloat16"], help="with --rollouts (default float32)"
    )
    diag.add_argument(
        "--adapter",
        metavar="DIR",
        help="with --rollouts: a PEFT adapter folder (rl-engine export RUN --to DIR) on --model",
    )
    diag.add_argument(
        "--skip-bad-lines",
        action="store_true",
        help="with --rollouts: skip malformed lines (counted in the report) instead of exiting 2",
    )
    diag.add_argument(
        "--output-dir",
        default=None,
        help="where the report goes (default: <output_dir>/diagnosis; runs/diagnose_rollouts)",
    )
    diag.set_defaults(fn=cmd_diagnose)
    bench = sub.add_parser("bench", help="benchmarks: invariant path vs. plain torch, same run")
    bench.add_argument("what", choices=list(BENCH_CASES))
    bench.add_argument("--quick", action="store_true", help="fewer shapes / repetitions")
    bench.add_argument(
        "--tiny",
        action="store_true",
        help="smoke run: tiny random model and shapes, one repetition (the figures mean nothing)",
    )
    bench.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="kernels: cpu = the cpu default backend (cpp) vs plain torch; cuda = triton vs cuBLAS / SDPA",
    )
    bench.add_argument(
        "--engine",
        choices=["own", "vllm"],
        default="own",
        help="rollout: own = rl_engine's engine (default); vllm = vLLM with rl_engine's plugin vs "
        "plain vLLM vs the own engine, whole-call tok/s (needs vllm installed, else its rows "
        "are skipped)",
    )
    bench.add_argument(
        "--case",
        choices=sorted({case for table in BENCH_CASES.values() for case in table if case}),
        default=None,
        help="kernels: gemm, decode-gemm (a decode step's GEMMs on streamed weights, packed per "
        "call vs once), native-linear or attention (default: the table of every op); "
        "rollout: decode (default), prefill (packed vs padded), tp (TP=2 vs TP=1) or tail "
        "(speculative decoding on a long-tailed step); train: "
        "invariance (on vs off), packing (packed vs padded step; default both) or mini-batches "
        "(parity_scope first vs all); job: real-size (default)",
    )
    bench.set_defaults(fn=cmd_bench)
    models = sub.add_parser("models", help="the converted-model cache of GGUF models")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    warm = models_sub.add_parser(
        "warm",
        help="convert GGUF models into the cache now (RL_ENGINE_CACHE_DIR, default "
        "~/.cache/rl_engine/models), so that their first load takes ~1 s; prints each folder",
    )
    warm.add_argument("spec", nargs="+", help="smollm2-135m-instruct or a path to a .gguf file")
    warm.set_defaults(fn=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    use_venv_op_cache()
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_diagnose_args(parser, args)
    _check_bench_args(parser, args)
    _setup_logging(args.verbose)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        logging.getLogger("rl_engine").error("%s", _one_line(err))  # one line on stderr
        return 2
    except KeyboardInterrupt:
        print("rl-engine: interrupted", file=sys.stderr)
        return 130


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split()) or type(err).__name__


if __name__ == "__main__":
    sys.exit(main())
