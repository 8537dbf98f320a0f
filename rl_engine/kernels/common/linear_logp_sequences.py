"""`linear_logp`'s layout-invariant backward: per-sequence head partials, row-invariant grad hidden.

The rows are those of the op's own `hidden` flattened (padded: (B, T-1), position t
scoring token t+1; packed: the packed rows), described by a SequenceSpans over them.
A row whose target is ignore_index has a zero upstream gradient: it contributes
nothing (skipped: a +0 added to a chain from +0 changes no bit, common/sequence_grads.py)
and its grad hidden is +0. A row with a live target outside every span is an error.

For each sequence, its live rows in order are cut into blocks of `chunk_rows_for(V)`
rows from its first live row (a block is never longer than a chunk, so the logits of
a block exist at once; the cut depends on the sequence and the vocabulary only):

- weight partial = sum over its blocks, in order, of the block's g^T h (one chain over
  the block's rows, the backend's ExactGemm, fp32), acc = block 0, then acc + block 1,
  ...; a sequence without live rows sends zeros. It goes to the sink deferred (a
  `ProductPartial` of those GEMMs' operands, evaluated by the sink a block of vocabulary
  rows at a time: the same bits, without a (V, H) buffer per sequence);
- bias partial = +0, then + grad_logits[row] (fp32) for its live rows in order;
- grad hidden[row] = g[row] @ W, one chain over the vocabulary, rounded once to hidden's
  dtype.

grad_logits = (onehot(target) - softmax(logits / T)) * grad_out / T in fp32, the logits
from the backend's `chunk_logprobs`, row-invariant; g = grad_logits in the weight's dtype
(the GEMMs' operand, as in the plain backward). Blocks are grouped into chunks of at most
`chunk_rows_for(V)` rows only for speed and memory, never for the bits.
"""

from __future__ import annotations

import torch

from rl_engine.kernels.common.checks import at_least_fp32
from rl_engine.kernels.common.product_partial import ProductPartial, settled
from rl_engine.kernels.common.sequence_grads import ExactGemm, row_sums, transposed


def check_targets_covered(spans, targets: torch.Tensor, ignore_index: int) -> None:
    """ValueError naming the first row whose target is live but which lies in no span."""
    stray = (targets.reshape(-1) != ignore_index) & ~spans.covered(targets.device)
    if bool(stray.any()):
        row = int(stray.nonzero()[0])
        raise ValueError(
            f"linear_logp: row {row} (of hidden's flattened rows) has a live target but lies in "
            f"no sequence of spans ({int(stray.sum())} such rows): its gradient would go nowhere"
        )


def _blocks(spans, live: torch.Tensor, block: int) -> list[tuple[int, torch.Tensor, bool]]:
    """(sequence, its live rows of one block, last block of the sequence?) in span order."""
    out = []
    for i in range(len(spans)):
        start, stop = spans.starts[i], spans.starts[i] + spans.lengths[i]
        rows = start + live[start:stop].nonzero().squeeze(1).cpu()
        cuts = list(range(0, rows.numel(), block))
        for j, a in enumerate(cuts):
            out.append((i, rows[a : a + block], j == len(cuts) - 1))
    return out


def _chunks(blocks, rows: int) -> list[list[tuple[int, torch.Tensor, bool]]]:
    """Consecutive blocks grouped so that a group holds at most `rows` rows."""
    groups, size = [], rows + 1
    for piece in blocks:
        if size + piece[1].numel() > rows:
            groups.append([])
            size = 0
        groups[-1].append(piece)
        size += piece[1].numel()
    return groups


def sequence_logp_backward(
    chunk_logprobs,
    chunk_rows_for,
    gemm: ExactGemm,
    grad_out,
    hidden,
    weight,
    bias,
    targets,
    temperature,
    ignore_index,
    spans,
    sink,
    needs,
):
    """grad hidden (or None); the head's partials go to the sink (roles "lm_head", "bias")."""
    acc = at_least_fp32(weight.dtype)
    vocab, step = weight.shape[0], chunk_rows_for(weight.shape[0])
    live = targets != ignore_index
    safe_targets = torch.where(live, targets, torch.zeros_like(targets))
    coeff = torch.where(live, grad_out.to(acc), torch.zeros_like(grad_out, dtype=acc))
    grad_hidden = torch.zeros_like(hidden) if needs[0] else None
    weight_t = transposed(weight, weight.dtype) if needs[0] else None  # (H, V)
    needs_bias = bias is not None and needs[2]
    bias_acc = (
        torch.zeros((len(spans), vocab), dtype=acc, device=weight.device) if needs_bias else None
    )
    weights = _WeightPartials(weight, sink, spans, acc)
    for group in _chunks(_blocks(spans, live, step), step):
        rows = torch.cat([piece[1] for piece in group])
        h = hidden[rows]  # (n, H)
        grad_logits = chunk_logprobs(h, weight, bias, temperature).exp_().neg_()  # (n, V)
        grad_logits.scatter_add_(1, safe_targets[rows, None], torch.ones_like(h[:, :1], dtype=acc))
        grad_logits.mul_(coeff[rows, None] / temperature)
        g = grad_logits.to(weight.dtype)  # the GEMMs' operand, as in the plain backward
        if needs[0]:
            grad_hidden[rows] = gemm(g, weight_t).to(hidden.dtype)
        if needs[1]:
            weights.add_blocks(gemm, g, h, group)
        if needs_bias:
            local, offset = [[] for _ in range(len(spans))], 0
            for i, block_rows, _ in group:
                local[i].append(torch.arange(offset, offset + block_rows.numel()))
                offset += block_rows.numel()
            mine = [torch.cat(r) if r else torch.zeros(0, dtype=torch.long) for r in local]
            bias_acc = row_sums(grad_logits, mine, init=bias_acc)
    if needs[1]:
        weights.send_until(len(spans))
    if needs_bias:
        for i, index in enumerate(spans.indices):
            sink.add(bias, "bias", index, bias_acc[i])
    return grad_hidden


class _WeightPartials:
    """The head weight's partials, sent in span order (the sink takes a parameter's sequences in
    increasing index); a sequence without live rows sends zeros.

    A sequence's partial is its blocks' g^T h added in order. It is sent deferred, as those
    GEMMs' operands (`ProductPartial`): the sink evaluates it a block of vocabulary rows at a
    time into the tree node it meets, so no (V, H) fp32 buffer exists per sequence. A sequence
    whose operands outgrow that buffer (more rows than the hidden size, in bf16) is evaluated
    here, its later blocks added into it: the same adds, in the same order."""

    def __init__(self, weight, sink, spans, acc):
        self.weight, self.sink, self.spans, self.acc = weight, sink, spans, acc
        self.pending: dict[int, ProductPartial | torch.Tensor] = {}
        self.sent = 0  # spans before this one were sent

    def add_blocks(self, gemm, g, h, group) -> None:
        """Each block's g^T h into its sequence's running sum; a sequence's last block sends it."""
        offset, dtype = 0, self.weight.dtype
        for i, block_rows, last in group:
            stop = offset + block_rows.numel()
            term = (transposed(g[offset:stop], dtype), transposed(h[offset:stop], dtype))
            offset = stop
            self.pending[i] = self._extended(gemm, self.pending.get(i), term)
            if last:
                self.send_until(i)
                self._send(i, self.pending.pop(i))

    @staticmethod
    def _extended(gemm, pending, term):
        """pending + gemm(term): deferred while the operands are smaller than the dense sum."""
        if isinstance(pending, torch.Tensor):
            return pending.add_(gemm(*term))
        terms = (pending.terms if pending is not None else ()) + (term,)
        return settled(ProductPartial(gemm, terms))

    def send_until(self, stop: int) -> None:
        """Zeros for the sequences before `stop` not sent yet (they had no live row)."""
        for i in range(self.sent, stop):
            self._send(i, torch.zeros(self.weight.shape, dtype=self.acc, device=self.weight.device))

    def _send(self, i: int, partial) -> None:
        self.sink.add(self.weight, "lm_head", self.spans.indices[i], partial)
        self.sent = i + 1
