"""`rl-engine train | diagnose | bench` — the command-line entry point."""

from __future__ import annotations

import argparse
import logging
import os
import sys


def _setup_logging(verbose: bool) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )


def _load_config(path: str):
    from rl_engine.config import RunConfig

    return RunConfig.from_yaml(path)


def cmd_train(args) -> int:
    from rl_engine.executors.ray_job import run_job

    config = _load_config(args.config)
    history = run_job(config)
    last = history[-1] if history else {}
    print(
        f"done: {len(history)} steps, outputs in {config.output_dir}; last parity exact-match "
        f"{last.get('parity/exact_match_fraction', float('nan')):.4f}"
    )
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
    args.dtype = args.dtype or "float32"


def cmd_bench(args) -> int:
    if args.what == "kernels" and args.device == "cuda":
        from rl_engine.benchmarks.gpu_kernels import main

        main([])
    elif args.what == "kernels":
        from rl_engine.benchmarks.kernels import main

        main(quick=args.quick)
    elif args.what == "rollout":
        from rl_engine.benchmarks.rollout import main

        main(["--dtype", "bfloat16", "--batch", "8", "--repeats", "1"] if args.quick else [])
    elif args.what == "train":
        from rl_engine.benchmarks.train_step import main

        main(quick=args.quick)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rl-engine", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run an RL job (Ray + DeepSpeed) from a YAML config")
    train.add_argument("--config", required=True, help="run config, e.g. configs/demo.yaml")
    train.set_defaults(fn=cmd_train)
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
    bench.add_argument("what", choices=["kernels", "rollout", "train"])
    bench.add_argument("--quick", action="store_true", help="fewer shapes / repetitions")
    bench.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cpu",
        help="kernels: cpu = native ops vs plain torch; cuda = triton vs cuBLAS / SDPA",
    )
    bench.set_defaults(fn=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_diagnose_args(parser, args)
    _setup_logging(args.verbose)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError, NotImplementedError) as err:
        logging.getLogger("rl_engine").error("%s", err)
        return 2


if __name__ == "__main__":
    sys.exit(main())
