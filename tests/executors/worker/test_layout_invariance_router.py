"""The MoE auxiliary loss under trainer.layout_invariant: the sequence-wise balance loss.

Unit level (rl_engine/executors/worker/layout_free/router_balance.py): a sequence's terms are HF's formula
over its own tokens, and the gradient its router logits get is the same bits alone, batched
with another sequence, padded wider or packed (negative control: HF's micro-batch formula's
is not). Worker level: a MoE policy with router_aux_loss_coef > 0 takes the same steps and
writes the same metrics in two layouts (negative control: the flag off differs).
"""

from __future__ import annotations

from fractions import Fraction

import pytest
import torch

from rl_engine.algorithms import load_balancing_loss
from rl_engine.executors.worker.layout_free.router_balance import (
    RouterRowsError,
    balance_weights,
    sequence_balance,
)
from rl_engine.kernels import SequenceSpans
from rl_engine.kernels.common.moe_router import select_top_k
from tests.helpers.worker.cell import cached_completions, cell_config
from tests.helpers.worker.layout_runs import (
    PACKED_ONE,
    run_layout,
    same_metrics,
    same_state,
)

K, LAYERS, N_A, N_B = 2, 2, 7, 5
SINGLES_TWO = (2, 3, {"micro_batch_size": 1, "packing": False})


def _sequence(experts: int, tokens: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(tokens, experts, generator=g) * 2 for _ in range(LAYERS)]


def _layouts(experts: int) -> dict[str, tuple[list[torch.Tensor], SequenceSpans, int]]:
    """Sequence A's router logits per layer in a micro-batch: (layers' logits (rows, E), the
    spans, A's first row). B: another sequence; pad rows carry logits too (as a forward's do)."""
    a, b = _sequence(experts, N_A, 1), _sequence(experts, N_B, 2)
    pad = _sequence(experts, 8, 3)
    alone = SequenceSpans.from_padding_mask(torch.tensor([[1] * N_A + [0] * 3]))
    wide = torch.tensor([[1] * N_B + [0] * 7, [1] * N_A + [0] * 5])
    packed_ids = torch.tensor([[0] * N_B + [1] * N_A + [-1] * 3])
    return {
        "alone": ([torch.cat([x, p[:3]]) for x, p in zip(a, pad)], alone, 0),
        "batched": (
            [torch.cat([y, p[:7], x, p[:5]]) for x, y, p in zip(a, b, pad)],
            SequenceSpans.from_padding_mask(wide),
            12,
        ),
        "packed": (
            [torch.cat([y, x, p[:3]]) for x, y, p in zip(a, b, pad)],
            SequenceSpans.from_segments(packed_ids),
            N_B,
        ),
    }


def _indices(logits: list[torch.Tensor]) -> list[torch.Tensor]:
    return [select_top_k(torch.softmax(x, -1), K)[1] for x in logits]


def _grads_of_a(experts: int, total: int, loss_of, dtype=torch.float32) -> dict:
    """A's rows of each layout's logits gradient under `loss_of(leaves, spans)`."""
    out = {}
    for name, (logits, spans, first) in _layouts(experts).items():
        leaves = [x.to(dtype).requires_grad_() for x in logits]
        loss_of(leaves, spans).backward()
        out[name] = torch.stack([x.grad[first : first + N_A] for x in leaves])
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts", [8, 60])
@pytest.mark.parametrize("threads", [1, 2])
def test_a_sequences_aux_gradient_is_the_same_in_any_micro_batch(experts, threads, dtype):
    total = 40  # the mini-batch's tokens: the same in every layout

    def sequence_wise(leaves, spans):
        term, _ = sequence_balance(leaves, _indices(leaves), spans, experts, total, 0.01)
        return term

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        grads = _grads_of_a(experts, total, sequence_wise, dtype)
    finally:
        torch.set_num_threads(before)
    assert grads["alone"].abs().sum() > 0 and grads["alone"].dtype == dtype
    assert torch.equal(grads["alone"], grads["batched"])
    assert torch.equal(grads["alone"], grads["packed"])


def test_negative_control_hfs_micro_batch_formula_gives_a_the_batchs_gradient():
    def micro_batch(leaves, spans):
        mask = spans.covered()
        share = float(mask.sum()) / 40
        return load_balancing_loss(leaves, _indices(leaves), 8, mask) * share * 0.01

    grads = _grads_of_a(8, 40, micro_batch)
    assert not torch.equal(grads["alone"], grads["batched"])
    assert not torch.equal(grads["alone"], grads["packed"])


def test_the_records_and_the_gradient_are_hfs_formula_per_sequence():
    """Each sequence's record is (n_s / N) x HF's loss over its tokens; the term's gradient is
    coef x that (values, not layouts: a tolerance for the sums' order)."""
    logits, spans, _ = _layouts(8)["batched"]
    leaves = [x.clone().requires_grad_() for x in logits]
    indices = _indices(leaves)
    total, coef = 40, 0.01
    term, records = sequence_balance(leaves, indices, spans, 8, total, coef)
    term.backward()
    for i, (lo, n) in enumerate(zip(spans.starts, spans.lengths)):
        own = [x.detach()[lo : lo + n].clone().requires_grad_() for x in logits]
        hf = load_balancing_loss(own, [ix[lo : lo + n] for ix in indices], 8) * n / total
        (hf * coef).backward()
        assert records.records[i].aux_loss == pytest.approx(float(hf.detach()), rel=1e-6)
        for leaf, ref in zip(leaves, own):
            torch.testing.assert_close(leaf.grad[lo : lo + n], ref.grad, rtol=1e-5, atol=1e-9)
    assert all(bool((leaf.grad[~spans.covered()] == 0).all()) for leaf in leaves)
    assert float(term.detach()) == pytest.approx(coef * sum(r.aux_loss for r in records.records))


def test_weights_are_rounded_once_from_the_exact_rational_and_rows_are_checked():
    got = balance_weights([3, 0, 1], tokens=4, total=10, layers=2, scale=0.01)
    exact = [Fraction(0.01) * Fraction(3 * c, 10 * 4 * 2 * 2) for c in (3, 0, 1)]
    assert got.tolist() == [float(value) for value in exact]
    assert got.dtype == torch.float64
    logits, spans, _ = _layouts(8)["alone"]
    with pytest.raises(RouterRowsError, match="span 10 rows"):
        sequence_balance([x[:9] for x in logits], _indices(logits), spans, 8, 40, 0.01)


@pytest.fixture(scope="module")
def moe_completions(tmp_path_factory):
    path = tmp_path_factory.mktemp("moe") / "moe.pt"
    torch.save(cached_completions("float32", "tiny-qwen3-moe"), path)
    return {"float32": str(path)}


def _moe(tmp_path, completions, layout, invariant=True, coef=0.01):
    algorithm = {"router_aux_loss_coef": coef}
    return run_layout(
        tmp_path,
        completions,
        layout,
        "float32",
        invariant=invariant,
        model="tiny-qwen3-moe",
        algorithm=algorithm,
    )


def test_the_mode_accepts_the_aux_loss():
    config = cell_config(
        0,
        1,
        "float32",
        "tiny-qwen3-moe",
        trainer={"layout_invariant": True},
        algorithm={"router_aux_loss_coef": 0.01},
    )
    assert config.trainer.layout_invariant and config.algorithm.router_aux_loss_coef == 0.01


@pytest.mark.exhaustive  # ~4 min on 2 cores: three runs
def test_a_moe_policy_with_the_aux_loss_takes_the_same_steps(tmp_path, moe_completions):
    one, two = (_moe(tmp_path, moe_completions, layout) for layout in (PACKED_ONE, SINGLES_TWO))
    assert same_state(one["state"], two["state"]) == []
    assert same_metrics(one["metrics"], two["metrics"]) == []
    assert one["metrics"][0]["router/aux_loss"] > 0
    assert one["metrics"][0]["router/max_load_share"] > 0
    without = _moe(tmp_path, moe_completions, PACKED_ONE, coef=0.0)
    assert same_state(one["state"], without["state"]) != []  # the aux loss moved the weights


@pytest.mark.exhaustive  # make test: the policy's negative control (test_layout_invariance.py)
def test_negative_control_the_plain_aux_loss_differs_between_layouts(tmp_path, moe_completions):
    one, two = (
        _moe(tmp_path, moe_completions, layout, invariant=False)
        for layout in (PACKED_ONE, SINGLES_TWO)
    )
    assert same_state(one["state"], two["state"]) != []
