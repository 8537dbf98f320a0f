"""The logprob memory probe (rl_engine/benchmarks/logp_memory.py): the materialised path is
log_softmax of the full logits gathered at the targets (at temperature 1 and another), the
probe prints its peak as JSON, and an unknown case names itself."""

from __future__ import annotations

import json

import pytest
import torch

from rl_engine.benchmarks.logp_memory import main, materialised_logprobs


def test_the_materialised_path_is_the_textbook_logprob():
    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(5, 8, generator=g), torch.randn(11, 8, generator=g)
    targets = torch.tensor([0, 3, 10, 2, 2])
    logits = hidden @ weight.T
    for temperature in (1.0, 0.5):
        expected = torch.log_softmax(logits / temperature, -1)[torch.arange(5), targets]
        got = materialised_logprobs(hidden, weight, targets, temperature)
        assert got.shape == (5,) and torch.allclose(got, expected, atol=1e-5)


def test_the_probe_prints_its_peak_and_refuses_an_unknown_case(capsys):
    main("materialise", 4, 8, 16, "float32")
    assert json.loads(capsys.readouterr().out)["peak_extra"] >= 0
    with pytest.raises(ValueError, match="case must be 'fused' or 'materialise', got 'both'"):
        main("both", 4, 8, 16, "float32")
