"""Where in the network the rollout's decode and the trainer's prefill first disagree.

Forward hooks record every module's output on both paths for one sequence:
the rollout side is the engine generating it alone (a prefill of the prompt,
then one decode forward per token); the trainer side is a single teacher-forced
forward of the finished sequence inside a right-padded batch with others. For
each module, in execution order, the outputs at every position are compared
bitwise. The first module that differs is where the mismatch shows; if that
module's input already differed, it was born in a functional op feeding it
(for `o_proj`, the attention kernel, which is a function, not a module).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rl_engine.patching import is_experts, is_router


@dataclass(frozen=True)
class ModuleDivergence:
    name: str
    equal: bool
    max_abs_diff: float
    input_equal: bool


class OutputRecorder:
    """Records each hooked module's output tensors, call after call, in first-call order.

    Mixture-of-experts routers and experts are not hooked: they see the call's
    tokens flattened (no batch layout to compare); their block's output is, and
    their routing is compared by rl_engine/diagnostics/routing.py.
    """

    def __init__(self, root: nn.Module):
        self.outputs: dict[str, list[torch.Tensor]] = {}
        self.inputs: dict[str, list[torch.Tensor]] = {}
        self._handles = [
            module.register_forward_hook(self._hook(name))
            for name, module in root.named_modules()
            if name
            and not isinstance(module, nn.ModuleList)
            and not name.endswith("rotary_emb")
            and not (is_router(module) or is_experts(module))
        ]

    def _hook(self, name):
        def record(_module, args, output):
            out = output[0] if isinstance(output, tuple) else output
            if isinstance(out, torch.Tensor) and out.dim() >= 2:
                self.outputs.setdefault(name, []).append(out.detach().clone())
                first = args[0] if args and isinstance(args[0], torch.Tensor) else out
                self.inputs.setdefault(name, []).append(first.detach().clone())

        return record

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


Trace = dict[str, tuple[torch.Tensor, torch.Tensor]]  # name -> (input, output), (positions, ...)


def decode_trace(recorder: OutputRecorder, positions: int) -> Trace:
    """One sequence's prefill + decode calls concatenated over time."""

    def over_time(calls):
        return torch.cat([c[0] for c in calls], dim=0)[
            :positions
        ]  # batch of one: drop it, stack time

    return {
        name: (over_time(recorder.inputs[name]), over_time(calls))
        for name, calls in recorder.outputs.items()
    }


def prefill_trace(recorder: OutputRecorder, row: int, positions: int) -> Trace:
    return {
        name: (recorder.inputs[name][0][row, :positions], calls[0][row, :positions])
        for name, calls in recorder.outputs.items()
    }


def compare_traces(rollout: Trace, trainer: Trace) -> list[ModuleDivergence]:
    rows = []
    for name, (a_in, a) in rollout.items():
        if name not in trainer or trainer[name][1].shape != a.shape:
            continue
        b_in, b = trainer[name]
        diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
        same_input = a_in.shape == b_in.shape and torch.equal(a_in, b_in)
        rows.append(ModuleDivergence(name, torch.equal(a, b), diff, same_input))
    return rows


def first_divergence(rows: list[ModuleDivergence]) -> ModuleDivergence | None:
    return next((r for r in rows if not r.equal), None)
