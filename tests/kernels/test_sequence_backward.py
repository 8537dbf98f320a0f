"""The layout-invariant backward (spans + sink): a sequence's partials and a token's input gradient
do not depend on how the micro-batch was laid out.

Chain checked, per op and dtype (fp32, bf16), cpp backend: the same five sequences run
(a) each alone in its own unpadded call, (b) all in one padded batch in a shuffled order,
left and right padded, (c) split into two padded micro-batches with extra padding, (d)
packed into rows; garbage (1e4-scale values) in every padding row. Then every sequence's
partial of every parameter (the sink's records) is torch.equal in (a) == (b) == (c) == (d),
and so is every token's input gradient. Negative control: today's plain backward, its
parameter gradients accumulated over a layout's micro-batches (zero upstream gradient on
padding), gives other bits in at least one pair of layouts.
Without a sink the plain backward runs, bit for bit (test_sequence_backward_edges.py, with
the edge cases and the thread counts), and the existing tests of each op
(tests/kernels/common/test_<op>.py, test_rowwise_ops.py) pass unchanged.
"""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers.invariance import skip_if_refused
from tests.helpers.kernels.sequence_backward import (
    DTYPES,
    INDICES,
    LENGTHS,
    OPS,
    ROLES,
    run_layout,
    same_partial,
)

# native: its own GEMM ops and attention; embedding, rms_norm and silu are the ones cpp runs
# (cpp's silu is its own kernel: native's too)
NATIVE_OPS = ["linear", "lm_head", "linear_logp", "moe_router", "moe_experts", "attention", "silu"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("op", "backend"), [(op, "cpp") for op in OPS] + [(op, "native") for op in NATIVE_OPS]
)
def test_partials_and_input_grads_do_not_depend_on_the_layout(op, backend, dtype):
    skip_if_refused(backend, dtype)
    run = functools.partial(run_layout, op, dtype=dtype, sink=True, backend=backend)
    reference, ref_grads, plain = run("alone", fill="garbage")
    assert all(g is None for g in plain.values())  # the parameters' gradients went to the sink
    roles = set(ROLES.get(op, {}).values())
    assert reference.keys() == {(role, index) for role in roles for index in INDICES}
    if op != "embedding":  # every other op has an input gradient
        assert ref_grads.keys() == set(range(len(LENGTHS)))
    for layout in ("padded", "two_micro_batches", "packed"):
        records, grads, _ = run(layout, fill="garbage")
        assert records.keys() == reference.keys(), layout
        for key, partial in reference.items():
            assert same_partial(records[key], partial), (layout, key)
        assert grads.keys() == ref_grads.keys()
        for i, grad in ref_grads.items():
            assert torch.equal(grads[i], grad), (layout, i)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "op", ["linear", "lm_head", "linear_logp", "embedding", "rms_norm", "moe_router", "moe_experts"]
)
def test_negative_control_plain_backward_depends_on_the_layout(op, dtype):
    """The plain backward's accumulated parameter gradients (zero gradient on padding, so every
    layout sums the same contributions) differ in some pair of layouts."""
    plains = [
        run_layout(op, layout, dtype, sink=False, fill="zeros")[2]
        for layout in ("alone", "padded", "two_micro_batches", "packed")
    ]
    differs = [
        name
        for name in plains[0]
        if not all(torch.equal(p[name], plains[0][name]) for p in plains[1:])
    ]
    assert differs, f"plain {op} gave the same bits in every layout"


@pytest.mark.parametrize("op", list(ROLES))
def test_partials_sum_to_the_plain_gradient(op):
    """Accuracy, fp32, packed: the sink's partials summed over the sequences (rows scattered
    into the dense shape) equal the plain backward's gradients to rounding, and so do the
    input gradients (zero upstream gradient on padding in both runs)."""
    records, grads, _ = run_layout(op, "packed", torch.float32, sink=True, fill="zeros")
    _, plain_grads, plain = run_layout(op, "packed", torch.float32, sink=False, fill="zeros")
    for name, role in ROLES[op].items():
        total = torch.zeros(plain[name].shape, dtype=torch.float64)
        for (r, _), value in records.items():
            if r != role:
                continue
            if isinstance(value, tuple):
                total.index_add_(0, value[0], value[1].double())
            else:
                total += value.double()
        torch.testing.assert_close(total, plain[name].double(), rtol=1e-4, atol=1e-4)
    for i, grad in grads.items():
        torch.testing.assert_close(grad, plain_grads[i], rtol=1e-4, atol=1e-5)
