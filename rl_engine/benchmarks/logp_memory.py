"""Peak extra memory of per-token logprobs: fused `linear_logp` vs. materialised logits.

Run as `python -m rl_engine.benchmarks.logp_memory {fused|materialise} N H V DTYPE`;
prints {"peak_extra": bytes}: the peak RSS while the op runs (VmHWM, reset just
before it) minus the RSS just before, inputs already allocated. One case per
fresh process (a smoke run may pass "fused,materialise": a line each, in order).
"""

from __future__ import annotations

import json
import sys

import torch

from rl_engine.benchmarks.timing import current_rss_bytes, peak_rss_bytes, reset_peak_rss
from rl_engine.kernels import get_op


def materialised_logprobs(hidden, weight, targets, temperature=1.0):
    """The plain path: full (N, V) logits, log_softmax, gather."""
    logits = torch.nn.functional.linear(hidden, weight).float()
    if temperature != 1.0:
        logits = logits / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


def main(case: str, n: int, hidden_size: int, vocab: int, dtype: str) -> None:
    for one in case.split(","):
        _measure(one, n, hidden_size, vocab, dtype)


def _measure(case: str, n: int, hidden_size: int, vocab: int, dtype: str) -> None:
    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    hidden = torch.randn(n, hidden_size, dtype=dt)
    weight = torch.randn(vocab, hidden_size, dtype=dt).mul_(hidden_size**-0.5)
    targets = torch.randint(0, vocab, (n,))
    fused = get_op("linear_logp", "cpu")
    reset_peak_rss()
    before = current_rss_bytes()
    if case == "fused":
        fused(hidden, weight, targets)
    elif case == "materialise":
        materialised_logprobs(hidden, weight, targets)
    else:
        raise ValueError(f"case must be 'fused' or 'materialise', got {case!r}")
    print(json.dumps({"peak_extra": peak_rss_bytes() - before}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
