"""Where two paths first disagree (rl_engine/diagnostics/divergence.py), on a small real module
tree: the recorder hooks every module (not ModuleLists), in first-call order, and unhooks on
exit; decode calls concatenate over time and a prefill row is cut to its positions; traces
compare bitwise per module, the first unequal module found, with whether its input already
differed (identical traces: none, the negative control)."""

from __future__ import annotations

import torch
from torch import nn

from rl_engine.diagnostics.divergence import (
    ModuleDivergence,
    OutputRecorder,
    compare_traces,
    decode_trace,
    first_divergence,
    prefill_trace,
)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Linear(3, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_the_recorder_hooks_each_module_and_unhooks_on_exit():
    net = Net()
    x = torch.randn(2, 5, 3)
    with OutputRecorder(net) as recorder:
        net(x)
        net(x[:, :1])
    assert list(recorder.outputs) == ["embed", "layers.0", "layers.1", "head"]
    assert [o.shape for o in recorder.outputs["head"]] == [(2, 5, 2), (2, 1, 2)]
    assert torch.equal(recorder.inputs["embed"][0], x)
    net(x)  # after exit: nothing more recorded
    assert len(recorder.outputs["head"]) == 2


def test_decode_and_prefill_traces_line_up_position_by_position():
    """One sequence decoded alone (prefill of 3, then 2 single steps) against its row of a
    padded batch: the same module outputs at the same 5 positions, bit for bit."""
    torch.manual_seed(0)
    net, seq = Net(), torch.randn(1, 5, 3)
    batch = torch.cat([torch.randn(1, 7, 3), torch.cat([seq, torch.zeros(1, 2, 3)], dim=1)])
    with OutputRecorder(net) as decode:
        net(seq[:, :3])
        net(seq[:, 3:4])
        net(seq[:, 4:5])
    with OutputRecorder(net) as prefill:
        net(batch)
    rollout, trainer = decode_trace(decode, 5), prefill_trace(prefill, 1, 5)
    assert {name: out.shape for name, (_, out) in rollout.items()} == {
        name: out.shape for name, (_, out) in trainer.items()
    }
    rows = compare_traces(rollout, trainer)
    assert [r.name for r in rows] == ["embed", "layers.0", "layers.1", "head"]
    assert all(r.max_abs_diff < 1e-5 for r in rows)  # a Linear's rows may round apart


def test_the_first_unequal_module_and_whether_its_input_differed():
    same = torch.arange(6.0).view(3, 2)
    other = same.clone()
    other[1, 1] += 0.5
    rollout = {"a": (same, same), "b": (same, same), "c": (same, same), "d": (same, same)}
    assert first_divergence(compare_traces(rollout, dict(rollout))) is None
    trainer = {"a": (same, same), "b": (same, other), "c": (other, other)}
    rows = compare_traces(rollout, trainer)
    assert [r.name for r in rows] == ["a", "b", "c"]  # "d": on one side only, skipped
    assert first_divergence(rows) == ModuleDivergence("b", False, 0.5, True)  # born in b
    assert rows[2] == ModuleDivergence("c", False, 0.5, False)  # inherited from b
    assert compare_traces({"x": (same, same)}, {"x": (same, same[:2])}) == []  # shapes differ
