"""Every benchmark runs, at a tiny size, and prints the table its full run prints.

Each test runs `rl-engine bench WHAT [--case CASE] --tiny` (a tiny random model and tiny
shapes, one repetition: seconds on any CPU, AVX2-only included) and reads the markdown
tables it printed: the rows the benchmark promises (every op, dtype, layout, case), every
time and ratio finite and non-negative (ratios positive; a time printed at two decimals can
round to 0.00 at this size), memory figures non-negative, and the parity a benchmark reports
exact. Nothing is asserted about speed: the figures of a tiny run mean nothing.

The job benchmark (`rl-engine bench job`: two Ray jobs of 2 ZeRO-3 ranks) is too heavy for a
smoke run: its parts are tested at the tiny shape instead (the model it saves, the run config
it writes, the memory sampler and its guard, the report), and its `--lora` comparison runs
at the tiny shape (slow). The Triton benchmark needs a GPU: on a CPU it must refuse.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import signal
import subprocess
import sys

import pytest
import torch

from rl_engine import cli
from rl_engine.kernels import OP_NAMES, kernel_facts

DTYPES = {"float32", "bfloat16"}
_SEPARATOR = re.compile(r"\|(\s*:?-+:?\s*\|)+")


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def tables(text: str) -> list[list[dict[str, str]]]:
    """Every markdown table in `text`, in order: its rows as {column header: cell}."""
    lines, found, i = text.splitlines(), [], 0
    while i < len(lines) - 1:
        if lines[i].startswith("|") and _SEPARATOR.fullmatch(lines[i + 1].strip()):
            header, rows, i = _cells(lines[i]), [], i + 2
            while i < len(lines) and lines[i].startswith("|"):
                rows.append(dict(zip(header, _cells(lines[i]), strict=True)))
                i += 1
            found.append(rows)
        else:
            i += 1
    return found


def number(cell: str) -> float:
    """A figure of a table cell ('12.3', '0.84x')."""
    value = float(cell.removesuffix("x"))
    assert math.isfinite(value), cell
    return value


def assert_figures(rows: list[dict[str, str]], times=(), ratios=(), memory=()) -> None:
    """Times and memory finite and >= 0, ratios finite and > 0, in every row."""
    assert rows
    for row in rows:
        for column in (*times, *memory):
            assert number(row[column]) >= 0, (column, row)
        for column in ratios:
            assert number(row[column]) > 0, (column, row)


def bench(capsys, *argv: str) -> list[list[dict[str, str]]]:
    """Run `rl-engine bench ... --tiny`; the tables it printed."""
    assert cli.main(["bench", *argv, "--tiny"]) == 0
    return tables(capsys.readouterr().out)


# ------------------------------------------------------------------------------ kernels


@pytest.mark.multiprocess  # the linear_logp memory probes: one fresh process each
def test_bench_kernels(capsys):
    timings, memory = bench(capsys, "kernels")
    ops = {"linear", "rms_norm", "silu", "log_softmax", "attention", "linear_logp"}
    assert ops <= set(OP_NAMES)
    assert {(r["op"], r["dtype"]) for r in timings} == {(op, dt) for op in ops for dt in DTYPES}
    assert len(timings) == 2 * 11  # a training and a decode shape per op (log_softmax: decode)
    plain = "batch_invariant=false (plain torch) ms"
    assert_figures(timings, times=("batch_invariant=true ms", plain), ratios=("ratio",))
    assert [r["linear_logp peak extra memory"] for r in memory] == ["24 tok x 300 vocab, float32"]
    assert_figures(memory, memory=("fused MiB", "materialised MiB"))


def test_bench_kernels_gemm(capsys):
    (rows,) = bench(capsys, "kernels", "--case", "gemm")
    from rl_engine.benchmarks.gemm import TINY_SHAPES

    expected = {(name, dt) for name, *_ in TINY_SHAPES for dt in ("fp32", "bf16")}
    assert {(r["shape"], r["dtype"]) for r in rows} == expected
    times = ("lm_head ms", "linear ms", "F.linear ms")
    assert_figures(rows, times=times, ratios=("lm_head / F", "linear / F"))


def test_bench_kernels_decode_gemm(capsys):
    (rows,) = bench(capsys, "kernels", "--case", "decode-gemm")
    assert [(r["dtype"], r["threads"], r["batch"]) for r in rows] == [
        ("bf16", "1", b) for b in ("1", "8", "32")
    ]
    assert_figures(rows, ratios=("gemm GB/s", "packed GB/s", "copy GB/s"))


def test_bench_kernels_attention(capsys):
    (rows,) = bench(capsys, "kernels", "--case", "attention")
    from rl_engine.benchmarks.attention_cpp import TINY_CASES

    expected = {(name, dt) for name, _ in TINY_CASES for dt in DTYPES}
    assert {(r["case"], r["dtype"]) for r in rows} == expected
    assert_figures(rows, times=("cpp ms", "SDPA ms"), ratios=("ratio",))


def test_bench_kernels_native_linear(capsys):
    """Through the module: only the dtypes the native backend's platform probe accepts here
    (a refused dtype raises, as the op does)."""
    from rl_engine.benchmarks import native_linear

    facts = kernel_facts("cpu", "native")
    dtypes = [s for s in ("fp32", "bf16") if facts[f"native_{s}_platform"] == "invariant"]
    if not dtypes:
        pytest.skip(f"the native backend refuses fp32 and bf16 here: {facts}")
    (rows,) = tables(native_linear.main(["--tiny", "--dtypes", *dtypes]))
    assert {(r["case"], r["dtype"]) for r in rows} == {
        (case, dt) for case, *_ in native_linear.TINY_SHAPES for dt in dtypes
    }
    assert_figures(rows, times=("native ms", "F.linear ms"), ratios=("native / F.linear",))


# ------------------------------------------------------------------------------ rollout


def test_bench_rollout_decode(capsys):
    """The decode rows with the roofline beside them, and the GRPO-shaped case (the benchmark
    raises if sharing the prefill changed a token or a logprob)."""
    rows, grpo = bench(capsys, "rollout")
    assert {r["dtype"] for r in rows} == DTYPES
    rates = ("(a) invariant tok/s", "(b) off tok/s", "(c) HF tok/s")
    assert_figures(rows, ratios=(*rates, "(a)/(c)", "(a)/(c) with prefill"))
    roofline = ("MB / step", "copy GB/s", "GFLOP / step", "GEMM GFLOP/s")
    limits = ("bytes limit tok/s", "FLOP limit tok/s")
    fractions = ("(a) / limit", "(a) / bytes limit", "(c) / limit")
    assert_figures(rows, ratios=(*roofline, *limits, *fractions))
    assert {r["bound"] for r in rows} <= {"memory", "compute"}
    (row,) = grpo
    assert row["tokens and logprobs"] == "equal"
    on, off = "whole call s, sharing on", "whole call s, off"
    first = ("1-token call s, on", "1-token call s, off")
    assert_figures(grpo, times=(on, off, *first), ratios=("off / on", "shared prefills"))
    assert number(row["prefill tokens on"]) < number(row["prefill tokens off"])


def test_bench_rollout_prefill(capsys):
    (rows,) = bench(capsys, "rollout", "--case", "prefill")
    from rl_engine.benchmarks.prefill import MIXES

    assert [r["prompt lengths"] for r in rows] == list(MIXES)
    assert_figures(rows, times=("padded ms", "packed ms"), ratios=("packed / padded",))
    assert all(number(r["padded / real tokens"]) >= 1 for r in rows)
    assert {r["default"] for r in rows} <= {"packed", "padded"}


@pytest.mark.multiprocess  # TP = 2 ranks and the TP = 1 references, each in new processes
@pytest.mark.slow
def test_bench_rollout_tensor_parallel(capsys):
    """TP = 2 samples the TP = 1 tokens (the benchmark raises otherwise), and the bytes a rank
    sent per decode token and layer are the design's formula."""
    measured, formula = bench(capsys, "rollout", "--case", "tp")
    (row,) = measured
    assert row["dtype"] == "float32"
    assert_figures(
        measured,
        times=("prefill TP=1 2 threads ms", "decode step TP=2 ms"),
        ratios=("TP2 / TP1 2 threads",),
    )
    sent = row["bytes sent / token / layer / rank (measured)"]
    assert number(sent) == number(formula[0]["this design, formula (bytes / token / layer / rank)"])


# ------------------------------------------------------------------------------ train


@pytest.mark.multiprocess  # the invariant and plain workers and the memory probes: processes
@pytest.mark.slow
def test_bench_train_invariance(capsys):
    steps, memory = bench(capsys, "train", "--case", "invariance")
    assert [(r["dtype"], r["ZeRO"]) for r in steps] == [("float32", "ZeRO-0")]
    assert_figures(
        steps,
        times=("step s (batch_invariant=true)", "step s (batch_invariant=false)"),
        ratios=("ratio",),
        memory=("peak extra MiB (true)", "peak extra MiB (false)"),
    )
    assert_figures(memory, memory=("fused MiB", "materialised MiB"))


@pytest.mark.multiprocess  # one DeepSpeed worker process per layout
@pytest.mark.slow
def test_bench_train_packing(capsys):
    (rows,) = bench(capsys, "train", "--case", "packing")
    padded, packed, ratio = rows
    assert padded["layout"].startswith("padded") and packed["layout"].startswith("packed")
    assert_figures([padded, packed], times=("step s",), memory=("peak extra MiB",))
    assert padded["parity"] == packed["parity"] == "1.0000"  # rollout logprobs == trainer's
    assert number(ratio["step s"]) > 0


@pytest.mark.exhaustive  # ~60 s; make test runs the mode itself (tests/executors/job/test_layout_job.py)
@pytest.mark.multiprocess  # 2 configurations x 2 gloo DeepSpeed ranks, one process each
@pytest.mark.slow
def test_bench_train_layout(capsys):
    steps, parts = bench(capsys, "train", "--case", "layout")
    assert [(r["dtype"], r["update"]) for r in steps] == [
        ("float32", "plain"),
        ("float32", "layout_invariant"),
    ]
    peaks = ("peak RSS rank 0", "peak RSS rank 1", "peak RSS sum", "peak extra sum")
    assert_figures(steps, times=("step s",), memory=peaks)
    assert_figures(steps[1:], ratios=("time ratio", "memory ratio"))
    assert [r["dtype"] for r in parts] == ["float32"]
    from rl_engine.executors.worker.layout_free.update import PARTS

    assert_figures(parts, times=("step s", *PARTS))
    assert number(parts[0]["sink tensors at the end"]) >= 1
    assert number(parts[0]["sink peak tensors (bound)"]) >= number(
        parts[0]["sink tensors at the end"]
    )


def test_bench_train_mini_batches(capsys):
    (rows,) = bench(capsys, "train", "--case", "mini-batches")
    assert [r["updates"] for r in rows] == ["1", "2", "2"]
    assert rows[1]["step"].endswith("parity_scope first")
    assert number(rows[1]["vs parity_scope first"]) == 1.0
    assert_figures(rows, times=("s",), ratios=("vs parity_scope first",))


# ------------------------------------------------------------------------------ moe


@pytest.mark.multiprocess  # the peak-memory probes: one fresh process each
def test_bench_moe(capsys):
    timings, memory = bench(capsys, "moe")
    assert {r["dtype"] for r in timings} == DTYPES and len(timings) == 6
    times = ("batch_invariant=true ms", "plain grouped_mm ms", "plain eager ms")
    assert_figures(timings, times=times, ratios=("ratio vs grouped_mm",))
    assert [r["experts"] for r in memory] == ["8"]
    assert_figures(memory, memory=("invariant MiB", "grouped_mm MiB"))


# ------------------------------------------------------------------------------ the job


def test_bench_job_model_and_run_configs_at_tiny_size(tmp_path):
    """The saved tiny model loads, is built once, and the configs the bench writes for both
    modes are valid run configs."""
    from rl_engine.benchmarks import real_size
    from rl_engine.config import RunConfig
    from rl_engine.models import load_model

    path = real_size.model_dir(tmp_path, "qwen2.5-tiny", None, 0)
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert real_size.model_dir(tmp_path, "qwen2.5-tiny", None, 0) == path
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp  # not built again
    model, _ = load_model(str(path))
    assert model.config.num_hidden_layers == 2 and model.config.vocab_size == real_size.VOCAB
    args = argparse.Namespace(seed=0, **real_size.TINY_ARGS)
    for invariant in (True, False):
        config = RunConfig.from_dict(real_size.job_config(path, tmp_path / "run", invariant, args))
        assert config.batch_invariant is invariant
        assert config.trainer.num_ranks == 2 and config.trainer.zero_stage == 3
    lora = real_size.job_config(path, tmp_path / "run", True, args, lora_rank=16)
    config = RunConfig.from_dict(lora)
    assert (config.lora.rank, config.lora.alpha, config.lora.target_modules) == (
        16,
        32,
        "all-linear",
    )
    assert set(real_size.QWEN25) >= {"qwen2.5-0.5b", "qwen2.5-1.5b"} and real_size.VOCAB == 151936


def _child(seconds: float) -> subprocess.Popen:
    """A process that holds 64 MB for `seconds`, in a session of its own (as the job runs)."""
    code = f"import time; x = bytearray(64 << 20); time.sleep({seconds})"
    return subprocess.Popen([sys.executable, "-c", code], start_new_session=True)


def test_bench_job_sampler_reads_a_process_and_its_guard_kills_it(tmp_path):
    from rl_engine.benchmarks.job_memory import GIB, Sampler

    proc = _child(2.0)
    sampler = Sampler(tmp_path, proc.pid, 0, lambda: os.killpg(proc.pid, signal.SIGKILL))
    assert proc.wait(timeout=60) == 0
    sampler.stop()
    assert not sampler.guard_tripped and sampler.baseline > 0
    assert sampler.peak_hwm["driver"] >= 64 << 20 and sampler.driver_rss
    assert sampler.peak_job_pss >= 64 << 20

    proc = _child(60.0)
    guard = 10**6 * GIB  # more than any machine has available: the guard trips at once
    sampler = Sampler(tmp_path, proc.pid, guard, lambda: os.killpg(proc.pid, signal.SIGKILL))
    try:
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        sampler.stop()
        if proc.poll() is None:
            proc.kill()
    assert sampler.guard_tripped


def test_bench_job_report():
    from rl_engine.benchmarks.real_size_report import environment, markdown

    env = environment()
    assert env["cpus"] >= 1 and env["total_gib"] > 0
    figures = [
        {
            "mode": mode,
            "weight_sync_s": 0.5 * scale,
            "train_compute_s": 2.0 * scale,
            "generate_compute_s": 1.0 * scale,
            "step_s": 4.0 * scale,
            "peak_extra_gib": 1.5 * scale,
            "peak_job_pss_gib": 1.0 * scale,
            "peak_rss_mib": {"driver": 300.0, "trainer 0": 900.0 * scale},
            "driver_rss_during_steps_mib": [290.0, 310.0],
            "parity_exact": [1.0, 1.0] if mode == "invariant" else [0.25, None],
        }
        for mode, scale in (("invariant", 2.0), ("plain", 1.0))
    ]
    (rows,) = tables(markdown(figures, env, env, "label"))
    by_title = {r[""]: r for r in rows}
    assert by_title["step s"] == {
        "": "step s",
        "invariant": "8.0",
        "plain": "4.0",
        "ratio": "2.00x",
    }
    assert by_title["peak RSS MiB, trainer 0"]["invariant"] == "1800"
    assert by_title["parity exact-match per step"]["plain"] == "0.25, -"


def test_bench_job_report_with_lora():
    """A LoRA run's column and the LoRA / full ratios (lora over the invariant full run)."""
    from rl_engine.benchmarks.real_size_report import environment, markdown

    env = environment()
    figures = [
        {
            "mode": mode,
            "train_compute_s": 2.0 * scale,
            "peak_extra_gib": 4.0 * scale,
            "sync_first_mib": 100.0,
            "sync_later_mib": 100.0 * scale**4,
            "pss_at_peak_mib": {"driver": 300.0, "trainer rank 0": 900.0 * scale},
            "driver_rss_during_steps_mib": None,
            "parity_exact": [1.0],
        }
        for mode, scale in (("invariant", 1.0), ("plain", 1.0), ("lora", 0.25))
    ]
    (rows,) = tables(markdown(figures, env, env, "label"))
    by_title = {r[""]: r for r in rows}
    assert by_title["train compute s"] == {
        "": "train compute s",
        "invariant": "2.0",
        "plain": "2.0",
        "lora": "0.5",
        "ratio": "1.00x",
        "lora / full": "0.25x",
    }
    assert by_title["weight_sync/bytes MiB, first sync"]["lora / full"] == "1.00x"
    later = by_title["weight_sync/bytes MiB, later syncs (median)"]
    assert (later["lora"], later["lora / full"]) == ("0.391", "0.0039x")  # significant digits
    assert by_title["PSS MiB at the job's peak, trainer rank 0"]["lora"] == "225"
    assert by_title["step s"]["lora / full"] == "-"  # a figure a run does not have


@pytest.mark.multiprocess  # two Ray jobs of 2 ZeRO-3 ranks and an engine each
@pytest.mark.slow
@pytest.mark.exhaustive  # make test keeps the report's LoRA columns (test_bench_job_report_with_lora)
def test_bench_job_lora_beside_the_full_weight_run(tmp_path, capsys):
    """`--lora RANK` at the tiny shape: the LoRA run beside the full-weight invariant run, with
    memory, the train / generate / sync split and weight_sync/bytes (first and later syncs)
    for each, and the LoRA / full ratios; a LoRA run's later syncs move its adapters alone."""
    from rl_engine.benchmarks import real_size

    argv = ["--tiny", "--lora", "2", "--modes", "invariant"]
    assert real_size.main([*argv, "--out", str(tmp_path / "out"), "--cache", str(tmp_path)]) == 0
    (rows,) = tables(capsys.readouterr().out)
    by_title = {r[""]: r for r in rows}
    assert set(rows[0]) == {"", "invariant", "lora", "lora / full"}
    ratios = (
        "peak extra system memory GiB",
        "peak of the job's own memory GiB (PSS of its processes)",
        "train compute s",
        "weight_sync/bytes MiB, first sync",
        "weight_sync/bytes MiB, later syncs (median)",
    )
    for title in (*ratios, "generate compute s", "weight sync s (median, steps 1..)"):
        assert_figures([by_title[title]], memory=("invariant", "lora"))
    assert_figures([by_title[title] for title in ratios], ratios=("lora / full",))
    later = by_title["weight_sync/bytes MiB, later syncs (median)"]
    assert number(later["lora / full"]) < 0.1
    pss = [r for title, r in by_title.items() if title.startswith("PSS MiB at the job's peak")]
    assert {r[""].split(", ", 1)[1] for r in pss} >= {
        "driver",
        "trainer rank 0",
        "rollout engine 0",
    }
    assert_figures(pss, memory=("invariant", "lora"))
    assert by_title["parity exact-match per step"]["lora"] == "1, 1"


# ------------------------------------------------------------------------------ GPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_bench_kernels_cuda_refuses_without_a_gpu():
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        cli.main(["bench", "kernels", "--device", "cuda", "--tiny"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_bench_kernels_cuda(capsys):
    (rows,) = bench(capsys, "kernels", "--device", "cuda")
    assert [r["op"] for r in rows] == [
        "matmul",
        "matmul",
        "matmul",
        "attention prefill",
        "attention decode",
        "linear_logp",
        "linear_logp peak MiB",
        "train step fwd+bwd",
    ]
    assert_figures(rows, ratios=("ratio",))
