"""The layout-invariant backward beside its layout tests (test_sequence_backward.py): its edge
cases (sequences and calls without rows, the plain backward when no sink is given), its
independence of the thread count, and the negative controls of single torch ops (batched
SDPA, torch's silu) that those layout tests stand against."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rl_engine.kernels import get_op
from rl_engine.kernels.common.linear import linear_backward
from rl_engine.kernels.common.linear_logp import chunked_logp_backward
from rl_engine.kernels.common.sequence_spans import SequenceSpans
from rl_engine.kernels.cpp.linear_logp import chunk_logprobs, chunk_rows_for
from tests.helpers.invariance import assert_equal_across_threads, skip_if_refused
from tests.helpers.kernels.sequence_backward import (
    DTYPES,
    HEAD_DIM,
    HEADS,
    IGNORE,
    KV_HEADS,
    LAYOUTS,
    Call,
    RecordingSink,
    check_a_sequence_without_rows_reports_zeros,
    gather,
    per_sequence,
    scatter,
)


@pytest.mark.parametrize("backend", ["cpp", "native"])
@pytest.mark.parametrize("op", ["linear", "lm_head", "rms_norm", "embedding"])
def test_a_sequence_without_rows_reports_zeros(op, backend):
    skip_if_refused(backend, torch.float32)
    check_a_sequence_without_rows_reports_zeros(op, backend)


@pytest.mark.parametrize("dtype", DTYPES)
def test_without_a_sink_the_backward_is_the_plain_one(dtype):
    """No spans / sink: the ops' gradients are, bit for bit, those of the plain backward
    functions (linear_backward, chunked_logp_backward), as before the mode existed."""
    g = torch.Generator().manual_seed(30)
    x = torch.randn(3, 70, 96, generator=g).to(dtype).requires_grad_(True)
    w = torch.nn.Parameter(torch.randn(80, 96, generator=g).to(dtype))
    b = torch.nn.Parameter(torch.randn(80, generator=g).to(dtype))
    dy = torch.randn(3, 70, 80, generator=g).to(dtype)
    get_op("linear", "cpu")(x, w, b).backward(dy)
    expected = linear_backward(dy.reshape(-1, 80), x.detach().reshape(-1, 96), w.detach(), True)
    for got, want in zip((x.grad.reshape(-1, 96), w.grad, b.grad), expected):
        assert torch.equal(got, want)

    V = 300
    h = torch.randn(3, 70, 96, generator=g).to(dtype).requires_grad_(True)
    head = torch.nn.Parameter(torch.randn(V, 96, generator=g).to(dtype))
    targets = torch.randint(0, V, (3, 70), generator=g)
    targets[:, :5] = IGNORE
    coeff = torch.randn(3, 70, generator=g)
    get_op("linear_logp", "cpu")(h, head, targets, temperature=0.7).backward(coeff)
    expected = chunked_logp_backward(
        chunk_logprobs,
        chunk_rows_for,
        coeff.reshape(-1),
        h.detach().reshape(-1, 96),
        head.detach(),
        None,
        targets.reshape(-1),
        0.7,
        IGNORE,
        needs=(True, True, False),
    )
    assert torch.equal(h.grad.reshape(-1, 96), expected[0])
    assert torch.equal(head.grad, expected[1])


@pytest.mark.parametrize("op", ["linear", "rms_norm", "embedding"])
def test_a_call_without_rows_reports_every_sequence(op):
    """Zero rows (every sequence empty here): each sequence still gets its +0 partial."""
    spans = SequenceSpans(0, (0, 0), (0, 0), (4, 9))
    sink = RecordingSink()
    if op == "embedding":
        weight = torch.nn.Parameter(torch.ones(10, 8))
        out = get_op(op, "cpu")(torch.zeros(0, dtype=torch.long), weight, spans=spans, sink=sink)
    else:
        weight = torch.nn.Parameter(torch.ones(4, 8) if op == "linear" else torch.ones(8))
        x = torch.zeros(0, 8, requires_grad=True)
        out = get_op(op, "cpu")(x, weight, spans=spans, sink=sink)
    out.sum().backward()
    assert {index for _, index in sink.records} == {4, 9}
    assert weight.grad is None


def _plain_attention_grads(call: Call) -> dict[int, torch.Tensor]:
    """The batched SDPA backward (what the cpp backward ran before) over one call, fp32."""
    B, T = call.shape
    leaves = [
        scatter(per_sequence(h * HEAD_DIM, torch.float32, 11 + j), call, "zeros")
        .view(B, T, h, HEAD_DIM)
        .requires_grad_(True)
        for j, h in enumerate((HEADS, KV_HEADS, KV_HEADS))
    ]
    positions = call.positions()
    live = positions >= 0
    mask = (positions[:, None, :] <= positions[:, :, None]) & live[:, None, :] & live[:, :, None]
    mask[:, :, 0] |= ~live  # a padding query attends somewhere (its gradient is 0)
    q, k, v = (t.transpose(1, 2) for t in leaves)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None], enable_gqa=True)
    dy = scatter(per_sequence(HEADS * HEAD_DIM, torch.float32, 14), call, "zeros")
    out.backward(dy.view(B, T, HEADS, HEAD_DIM).transpose(1, 2))
    return gather(leaves[0].grad.reshape(B, T, -1), call)


def test_negative_control_batched_attention_backward_depends_on_the_layout():
    """SDPA's backward over a whole padded batch: some sequence's dq differs from its own call's."""
    alone_grads = {}
    for call in LAYOUTS["alone"]:
        alone_grads.update(_plain_attention_grads(call))
    batched = _plain_attention_grads(LAYOUTS["padded"][0])
    assert any(not torch.equal(batched[i], alone_grads[i]) for i in alone_grads)


def test_negative_control_torch_silu_backward_depends_on_the_position():
    """torch's own silu backward (fp32): an element's gradient bits follow its position."""
    g = torch.Generator().manual_seed(0)
    x, dy = torch.randn(1000, generator=g) * 4, torch.randn(1000, generator=g)

    def grad(offset):  # element j sits at j + offset
        leaf = torch.cat([torch.zeros(offset), x]).requires_grad_(True)
        F.silu(leaf).backward(torch.cat([torch.zeros(offset), dy]))
        return leaf.grad[offset:]

    assert any(not torch.equal(grad(offset), grad(0)) for offset in range(1, 40))


@pytest.mark.threads
@pytest.mark.parametrize(
    ("op", "backend"),
    [(op, "cpp") for op in ("linear", "linear_logp", "rms_norm", "embedding", "attention")]
    + [("moe_experts", "cpp"), ("linear", "native"), ("attention", "native")],
)
def test_partials_and_input_grads_do_not_depend_on_the_thread_count(op, backend):
    """bf16, packed: the same records and input gradients with 1, 2 and 3 intra-op threads."""
    skip_if_refused(backend, torch.bfloat16)
    code = f"""
        import torch
        from tests.helpers.kernels.sequence_backward import run_layout
        records, grads, _ = run_layout(
            {op!r}, "packed", torch.bfloat16, sink=True, fill="garbage", backend={backend!r}
        )
        result = {{f"grad {{i}}": g for i, g in grads.items()}}
        for (role, index), p in records.items():
            parts = p if isinstance(p, tuple) else (p,)  # add_rows: (rows, values)
            result.update({{f"{{role}} {{index}} {{j}}": t for j, t in enumerate(parts)}})
    """
    assert_equal_across_threads(code)
