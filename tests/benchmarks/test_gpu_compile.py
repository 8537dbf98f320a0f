"""The command line of scripts/compile_gpu_kernels.py (rl_engine/benchmarks/gpu_compile.py): its
defaults, and usage errors (an unknown op, an unknown target, --launch without a GPU) that exit
2 naming what is wrong before anything is compiled."""

from __future__ import annotations

import pytest
import torch

from rl_engine.benchmarks.gpu_compile import build_parser, main


def test_the_defaults_are_every_op_on_three_targets():
    args = build_parser().parse_args([])
    assert (args.targets, args.cases, args.launch, args.compare) == (
        "sm_80,sm_90,sm_100",
        "all",
        False,
        None,
    )


def test_an_unknown_op_is_a_usage_error(capsys, tmp_path):
    assert main(["--ops", "linear,nope", "--out", str(tmp_path)]) == 2
    assert "unknown ops: ['nope']" in capsys.readouterr().err
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_launch_without_a_gpu_or_an_unknown_target_is_a_usage_error(capsys, tmp_path):
    launch = main(["--launch", "--out", str(tmp_path)])
    target = main(["--targets", "sm_7x", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert (launch, target) == (2, 2)
    assert ("--launch needs a CUDA device" in err or "triton" in err.lower()) and not (
        tmp_path / "manifest.json"
    ).exists()
