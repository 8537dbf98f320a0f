"""Routing agreement of a mixture-of-experts model between the rollout engine and the trainer.

Both sides record, for every sparse layer and every token, what its router
saw and decided (`rl_engine.patching.RoutingRecorder`: the router's input,
logits and top-k expert list, and the experts' output):
- rollout: during the engine's own `generate` (continuous batching, KV cache,
  decode one token at a time). Each forward's rows are mapped back to
  (sequence, position) through the cache's binding (`SlotKVCache.bound`):
  a row at position 0 opens a new sequence in its slot; the occupancies are
  then matched to the completions by their token ids;
- trainer: the teacher-forced recompute of the same completions.
Per layer it reports the fraction of tokens whose top-k expert list (in the
router's order) is identical. For the first layer (in model order) where any
token's router logits or experts output differ, it says which diverged first:
`router` (the logits differ; `input_equal` tells whether the router's input
already differed, i.e. the divergence was born upstream) or `experts` (the same
logits and routing, a different experts output).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch import nn

from rl_engine.patching import KV_CACHE_KWARG, RoutingRecorder, moe_layers

# per sequence, per layer: (inputs (T, H), logits (T, E), indices (T, k), experts_out (T, H))
SeqRouting = dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class LayerAgreement:
    layer: str
    tokens: int
    routing_agreement: float
    """Fraction of tokens whose top-k expert list is identical (order included)."""
    logits_equal: float
    """Fraction of tokens whose router logits are bitwise equal."""
    experts_equal: float
    """Fraction of tokens whose experts output is bitwise equal."""


@dataclass(frozen=True)
class RoutingReport:
    layers: list[LayerAgreement]
    first_divergent_layer: str | None = None
    diverged_first: str | None = None
    """'router' or 'experts' (see the module docstring); None when nothing diverged."""
    input_equal: bool | None = None
    """In the first divergent layer: whether every router input was equal (born in the block)."""
    tokens_router_differs: int = 0
    tokens_experts_differ: int = 0
    """Tokens of the first divergent layer whose logits differ / whose logits are equal but experts
    output differs."""

    @property
    def min_agreement(self) -> float:
        return min((a.routing_agreement for a in self.layers), default=1.0)


@dataclass
class EngineRoutingTrace:
    """Open around `engine.generate(...)`: every forward's routing with each row's slot, position
    and input token. `sequences(completions)` turns it into per-completion routing."""

    model: nn.Module
    _batches: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    _recorder: RoutingRecorder | None = None
    _handle: object = None

    def __enter__(self) -> EngineRoutingTrace:
        self._recorder = RoutingRecorder(self.model, inputs=True, experts=True).__enter__()
        self._handle = self.model.base_model.register_forward_pre_hook(
            self._record_rows, with_kwargs=True
        )
        return self

    def __exit__(self, *exc) -> None:
        self._handle.remove()
        self._recorder.close()

    def _record_rows(self, _module, _args, kwargs):
        cache = kwargs.get(KV_CACHE_KWARG)
        if cache is None:
            raise RuntimeError("EngineRoutingTrace records RolloutEngine forwards only")
        slots, positions = cache.bound()
        ids = kwargs["input_ids"]
        self._batches.append((ids.detach().cpu(), slots.cpu(), positions.cpu()))

    def sequences(self, completions) -> list[SeqRouting]:
        """Each completion's routing at the positions the engine fed (prompt + all but the last
        sampled token), in the completions' order."""
        occupancies = self._occupancies()
        by_tokens = defaultdict(list)
        for tokens, routing in occupancies:
            by_tokens[tuple(tokens)].append(routing)
        out = []
        for c in completions:
            fed = tuple(list(c.prompt_ids) + list(c.token_ids[:-1]))
            matches = by_tokens.get(fed)
            if not matches:
                raise RuntimeError(
                    f"completion (prompt {c.prompt_index}, sample {c.sample_index}) was not seen "
                    "in the recorded engine forwards"
                )
            out.append(matches.pop(0))
        return out

    def _occupancies(self) -> list[tuple[list[int], SeqRouting]]:
        """(fed token ids, routing) of every sequence that held a slot, in admission order."""
        layers = list(self._recorder.calls)
        done, open_seqs = [], {}
        for call_index, (ids, slots, positions) in enumerate(self._batches):
            width, per_token = ids.shape[1], slots.dim() == 2  # per token: a packed prefill
            for row in range(ids.shape[0]):
                for col in range(width):
                    pos = int(positions[row, col])
                    if pos < 0:
                        continue
                    slot = int(slots[row, col] if per_token else slots[row])
                    if pos == 0:  # a prefill starts a new sequence in this slot
                        if slot in open_seqs:
                            done.append(open_seqs.pop(slot))
                        open_seqs[slot] = ([], defaultdict(list))
                    tokens, rows = open_seqs[slot]
                    tokens.append(int(ids[row, col]))
                    flat = row * width + col
                    for layer in layers:
                        rows[layer].append((call_index, flat))
        done.extend(open_seqs.values())
        return [(tokens, self._gather(rows)) for tokens, rows in done]

    def _gather(self, rows: dict) -> SeqRouting:
        out = {}
        for layer, picks in rows.items():
            calls = self._recorder.calls[layer]
            parts = [
                [
                    calls[i].inputs[r],
                    calls[i].logits[r],
                    calls[i].indices[r],
                    calls[i].experts_out[r],
                ]
                for i, r in picks
            ]
            out[layer] = tuple(torch.stack(column) for column in zip(*parts))
        return out


def trainer_routing(
    recorder: RoutingRecorder, completions, micro_batch_size: int, *, packing: bool = False
) -> list[SeqRouting]:
    """Per-completion routing of the trainer's recompute (`report.trainer_logprobs`: micro-batches
    of `micro_batch_size`, one forward each, right-padded or packed into one row in order),
    recorded by `recorder`."""
    out = []
    for chunk_index, start in enumerate(range(0, len(completions), micro_batch_size)):
        chunk = completions[start : start + micro_batch_size]
        lengths = [len(c.prompt_ids) + len(c.token_ids) for c in chunk]
        width = max(lengths)
        offsets = [sum(lengths[:row]) if packing else row * width for row in range(len(lengths))]
        for offset, length in zip(offsets, lengths):
            rows = slice(offset, offset + length)
            out.append(
                {
                    layer: tuple(
                        t[rows]
                        for t in (
                            calls[chunk_index].inputs,
                            calls[chunk_index].logits,
                            calls[chunk_index].indices,
                            calls[chunk_index].experts_out,
                        )
                    )
                    for layer, calls in recorder.calls.items()
                }
            )
    return out


def compare_routing(
    model: nn.Module, rollout: list[SeqRouting], trainer: list[SeqRouting]
) -> RoutingReport:
    """Per layer agreement and the first divergent layer; trainer rows are cut to the rollout's."""
    layers, first = [], {}
    for layer in moe_layers(model):
        route, logits, out, inputs = _layer_equalities(layer, rollout, trainer)
        layers.append(
            LayerAgreement(
                layer,
                int(route.numel()),
                float(route.float().mean()),
                float(logits.float().mean()),
                float(out.float().mean()),
            )
        )
        if not first and not bool((logits & out).all()):
            router, experts = int((~logits).sum()), int((logits & ~out).sum())
            first = {
                "first_divergent_layer": layer,
                "diverged_first": "router" if router else "experts",
                "input_equal": bool(inputs.all()),
                "tokens_router_differs": router,
                "tokens_experts_differ": experts,
            }
    return RoutingReport(layers, **first)


def _layer_equalities(layer, rollout, trainer):
    """(same top-k, same logits, same experts output, same router input), each (tokens,) bool."""
    columns = [[], [], [], []]
    for a, b in zip(rollout, trainer, strict=True):
        a_in, a_logits, a_idx, a_out = a[layer]
        n = a_idx.shape[0]
        b_in, b_logits, b_idx, b_out = (t[:n] for t in b[layer])
        columns[0].append((a_idx == b_idx).all(-1))
        columns[1].append(_rows_equal(a_logits, b_logits))
        columns[2].append(_rows_equal(a_out, b_out))
        columns[3].append(_rows_equal(a_in, b_in))
    return tuple(torch.cat(c) for c in columns)


def _rows_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """(T,) bool: row t of a and b bitwise equal (NaN-free data: torch.equal per row)."""
    return (a == b).all(-1) | (a.isnan() & b.isnan()).all(-1)
