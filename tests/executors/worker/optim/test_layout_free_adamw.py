"""AdamW whose update of an element depends on that element alone
(executors/worker/optim/layout_free_adamw.py).

Equality chain: the same elements as one flat parameter == cut into partitions at odd places
== stepped in chunks of 7 elements, after three armed steps with a clip coefficient, fp32 and
bf16, weights and both moments compared with torch.equal. Control (the comparison sees a
change): one element's gradient moved by one ulp changes that element's moments and no
other's.
Unarmed, a step only creates the state (DeepSpeed's construction-time step with zero gradients),
where torch's AdamW decays the weights (the control). The first armed step is lr * g / |g|
(bias-corrected moments, eps 0); bad hyperparameters and a closure are refused by name.
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.executors.worker.optim import layout_free_adamw
from rl_engine.executors.worker.optim.layout_free_adamw import LayoutFreeAdamW

N = 1000


def _stepped(cuts: list[int], dtype: torch.dtype, nudge: int | None = None) -> dict:
    """The weights and moments after three armed steps, the elements cut at `cuts`; `nudge`:
    the element whose every gradient moves up one ulp."""
    torch.manual_seed(0)
    parts = [torch.nn.Parameter(p.clone()) for p in torch.randn(N).to(dtype).split(cuts)]
    optimizer = LayoutFreeAdamW(parts, lr=1e-3, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        grad = (torch.randn(N, generator=generator) * 10.0**step).to(dtype)
        if nudge is not None:
            grad[nudge] = torch.nextafter(grad[nudge], torch.tensor(math.inf, dtype=dtype))
        for param, piece in zip(parts, grad.split(cuts)):
            param.grad = piece.clone()
        optimizer.arm(0.5)
        optimizer.step()
    states = [optimizer.state[p] for p in parts]
    return {
        "weights": torch.cat([p.detach() for p in parts]),
        "exp_avg": torch.cat([s["exp_avg"] for s in states]),
        "exp_avg_sq": torch.cat([s["exp_avg_sq"] for s in states]),
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_an_elements_update_does_not_depend_on_the_partition_or_the_chunk(dtype, monkeypatch):
    whole = _stepped([N], dtype)
    for cuts in ([3, 997], [501, 2, 497]):
        cut = _stepped(cuts, dtype)
        assert all(torch.equal(cut[k], whole[k]) for k in whole), cuts
    monkeypatch.setattr(layout_free_adamw, "CHUNK", 7)
    chunked = _stepped([N], dtype)
    assert all(torch.equal(chunked[k], whole[k]) for k in whole)
    # control: one element's gradient one ulp up changes that element's moments, no other's
    nudged = _stepped([3, 997], dtype, nudge=500)
    for key in ("exp_avg", "exp_avg_sq"):
        changed = (nudged[key] != whole[key]).nonzero().flatten().tolist()
        assert changed == [500], key
    assert torch.equal(nudged["weights"][:500], whole["weights"][:500])


def test_an_unarmed_step_only_creates_the_state():
    weight = torch.nn.Parameter(torch.ones(4))
    weight.grad = torch.zeros(4)
    optimizer = LayoutFreeAdamW([weight], lr=0.1, weight_decay=0.1)
    optimizer.step()
    state = optimizer.state[weight]
    assert torch.equal(weight.detach(), torch.ones(4)) and int(state["step"]) == 0
    assert torch.equal(state["exp_avg"], torch.zeros(4))
    # control: torch's AdamW takes that zero-gradient step, decaying the weights
    theirs = torch.nn.Parameter(torch.ones(4))
    theirs.grad = torch.zeros(4)
    torch.optim.AdamW([theirs], lr=0.1, weight_decay=0.1).step()
    assert not torch.equal(theirs.detach(), torch.ones(4))


def test_the_first_armed_step_moves_each_weight_by_lr_against_its_gradient():
    weight = torch.nn.Parameter(torch.tensor([1.0, 1.0, 1.0]))
    weight.grad = torch.tensor([2.0, -3.0, 0.5])
    optimizer = LayoutFreeAdamW([weight], lr=0.25, eps=0.0)
    optimizer.arm(None)
    optimizer.step()
    got = weight.detach().tolist()
    assert all(math.isclose(g, w, rel_tol=1e-6) for g, w in zip(got, [0.75, 1.25, 0.75]))
    assert int(optimizer.state[weight]["step"]) == 1


def test_bad_hyperparameters_and_a_closure_are_refused():
    weight = torch.nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"lr=-1.0, betas=\(0.9, 0.999\).* out of range"):
        LayoutFreeAdamW([weight], lr=-1.0)
    with pytest.raises(ValueError, match=r"betas=\(0.9, 1.0\)"):
        LayoutFreeAdamW([weight], lr=1e-3, betas=(0.9, 1.0))
    with pytest.raises(ValueError, match="takes no closure"):
        LayoutFreeAdamW([weight], lr=1e-3).step(lambda: 0.0)
