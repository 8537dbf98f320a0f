"""The command line of scripts/compile_gpu_kernels.py (rl_engine/diagnostics/gpu_compile.py): its
defaults, and the refusals (an unknown op; no compiled Triton kernels) that exit 2 naming what
is wrong before anything is compiled or written."""

from __future__ import annotations

import pytest

from rl_engine.diagnostics.gpu_compile import build_parser, main
from rl_engine.kernels.compile_check import require_compiled_kernels


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


def test_without_compiled_kernels_it_refuses_before_writing_anything(capsys, tmp_path):
    """Under the Triton interpreter (the tests without a GPU) there is nothing to compile:
    exit 2 with the reason, and no manifest."""
    try:
        require_compiled_kernels()
    except RuntimeError as err:
        reason = str(err)
    else:
        pytest.skip("the Triton kernels are compiled here")
    assert main(["--out", str(tmp_path)]) == 2
    assert reason in capsys.readouterr().err
    assert not (tmp_path / "manifest.json").exists()
