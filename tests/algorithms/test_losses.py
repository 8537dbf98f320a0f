"""Tests for the PPO/GRPO policy loss, k3 KL, TIS weights and masked_mean.

Expected values are written out from the formulas by hand, not by calling the
function under test a second time.
"""

import math

import pytest
import torch

from rl_engine.algorithms import (
    AGGREGATIONS,
    kl_k3,
    masked_mean,
    policy_loss,
)


def _logs(*ratios: float) -> torch.Tensor:
    """Log-ratios as a [1, T] row: new logprobs when the old logprobs are 0."""
    return torch.tensor([[math.log(r) for r in ratios]])


# ---------------------------------------------------------------- policy_loss


def test_clipping_on_both_sides_for_both_advantage_signs():
    # eps = 0.2, so the trust region is [0.8, 1.2].
    #   A=+1, r=1.5: min(1.5, 1.2)  = 1.2  -> loss -1.2   clipped (no gradient)
    #   A=+1, r=0.5: min(0.5, 0.8)  = 0.5  -> loss -0.5   not clipped
    #   A=-1, r=0.5: min(-0.5,-0.8) = -0.8 -> loss +0.8   clipped (no gradient)
    #   A=-1, r=1.5: min(-1.5,-1.2) = -1.5 -> loss +1.5   not clipped
    logprobs = _logs(1.5, 0.5, 0.5, 1.5).requires_grad_()
    old = torch.zeros(1, 4)
    adv = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    mask = torch.ones(1, 4)
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2)

    torch.testing.assert_close(loss, torch.tensor((-1.2 - 0.5 + 0.8 + 1.5) / 4))
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)
    loss.backward()
    # d/dlogp of -A*r/4 is -A*r/4 where unclipped, 0 where clipped.
    expected_grad = torch.tensor([[0.0, -1.0 * 0.5 / 4, 0.0, 1.0 * 1.5 / 4]])
    torch.testing.assert_close(logprobs.grad, expected_grad)


def test_inside_trust_region_nothing_is_clipped():
    logprobs = _logs(1.1, 0.9, 1.1, 0.9)
    adv = torch.tensor([[2.0, 2.0, -2.0, -2.0]])
    loss, stats = policy_loss(logprobs, torch.zeros(1, 4), adv, torch.ones(1, 4))
    torch.testing.assert_close(loss, torch.tensor(-(2.2 + 1.8 - 2.2 - 1.8) / 4))
    assert float(stats["clip_fraction"]) == 0.0


def test_clip_eps_high_widens_only_the_upper_bound():
    logprobs, old = _logs(1.25, 0.7), torch.zeros(1, 2)
    adv, mask = torch.tensor([[1.0, -1.0]]), torch.ones(1, 2)
    # Symmetric 0.2: r=1.25 clipped to 1.2; r=0.7 (A<0) clipped to 0.8.
    loss, _ = policy_loss(logprobs, old, adv, mask, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor((-1.2 + 0.8) / 2))
    # clip-higher 0.28: r=1.25 is inside [0.8, 1.28]; the lower side is unchanged.
    loss, stats = policy_loss(logprobs, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    torch.testing.assert_close(loss, torch.tensor((-1.25 + 0.8) / 2))
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)


def test_ratio_one_gives_minus_mean_advantage_and_gradient_follows_advantage():
    logprobs = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -4.0, -1.5]], requires_grad=True)
    old = logprobs.detach().clone()
    adv = torch.tensor([3.0, -1.0])  # per sequence, broadcast over tokens
    mask = torch.ones(2, 3)
    loss, stats = policy_loss(logprobs, old, adv, mask)
    torch.testing.assert_close(loss, torch.tensor(-(3.0 * 3 - 1.0 * 3) / 6))
    loss.backward()
    # Gradient descent raises logprobs of positive-advantage tokens, lowers negative ones.
    torch.testing.assert_close(
        logprobs.grad, torch.tensor([[-0.5, -0.5, -0.5], [1 / 6, 1 / 6, 1 / 6]])
    )
    assert float(stats["ratio_mean"]) == 1.0 and float(stats["ratio_max"]) == 1.0
    assert float(stats["approx_kl"]) == 0.0 and float(stats["clip_fraction"]) == 0.0


def test_per_sequence_advantages_equal_explicitly_expanded_ones():
    g = torch.Generator().manual_seed(0)
    logprobs, old = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    adv = torch.tensor([1.0, -2.0, 0.5])
    mask = torch.ones(3, 5)
    a, _ = policy_loss(logprobs, old, adv, mask)
    b, _ = policy_loss(logprobs, old, adv[:, None].expand(3, 5), mask)
    assert torch.equal(a, b)


def _ragged_case():
    # Ratio 1 everywhere, so the per-token loss is just -A:
    #   row 0: [-1, -2, -3] (3 tokens), row 1: [-10] (1 token, then padding).
    logprobs = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 2.0, 3.0], [10.0, 99.0, 99.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return logprobs, adv, mask


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token-mean", (-1 - 2 - 3 - 10) / 4),  # -4
        ("seq-mean-token-mean", ((-1 - 2 - 3) / 3 + -10 / 1) / 2),  # -6
        ("seq-mean-token-sum", ((-1 - 2 - 3) + -10) / 2),  # -8
    ],
)
def test_aggregations_on_ragged_mask(aggregation, expected):
    logprobs, adv, mask = _ragged_case()
    loss, _ = policy_loss(logprobs, logprobs, adv, mask, aggregation=aggregation)
    torch.testing.assert_close(loss, torch.tensor(float(expected)))


def test_seq_mean_token_mean_skips_empty_sequences():
    logprobs, adv, mask = _ragged_case()
    logprobs = torch.cat([logprobs, torch.zeros(1, 3)])
    adv = torch.cat([adv, torch.full((1, 3), 50.0)])
    mask = torch.cat([mask, torch.zeros(1, 3, dtype=mask.dtype)])
    loss, _ = policy_loss(logprobs, logprobs, adv, mask, aggregation="seq-mean-token-mean")
    torch.testing.assert_close(loss, torch.tensor(-6.0))
    # token-sum averages over all B rows: the empty row counts as 0.
    loss, _ = policy_loss(logprobs, logprobs, adv, mask, aggregation="seq-mean-token-sum")
    torch.testing.assert_close(loss, torch.tensor(-16.0 / 3))


def test_garbage_at_padding_never_reaches_loss_or_gradient():
    logprobs = torch.tensor([[-1.0, 1e4, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.0, -1e4, float("inf")]])
    mask = torch.tensor([[True, False, False]])
    loss, stats = policy_loss(logprobs, old, torch.tensor([2.0]), mask)
    torch.testing.assert_close(loss, torch.tensor(-2.0))
    loss.backward()
    torch.testing.assert_close(logprobs.grad, torch.tensor([[-2.0, 0.0, 0.0]]))
    assert all(math.isfinite(float(v)) for v in stats.values())


def test_is_weights_scale_per_token_loss_and_get_no_gradient():
    logprobs = torch.zeros(1, 3, requires_grad=True)
    adv = torch.tensor([[1.0, 2.0, -4.0]])
    weights = torch.tensor([[2.0, 0.5, 0.25]], requires_grad=True)
    loss, _ = policy_loss(logprobs, torch.zeros(1, 3), adv, torch.ones(1, 3), is_weights=weights)
    # per-token -A*w = [-2, -1, +1]; mean over 3 tokens.
    torch.testing.assert_close(loss, torch.tensor((-2.0 - 1.0 + 1.0) / 3))
    loss.backward()
    assert weights.grad is None


def test_stats_are_hand_computable():
    logprobs = _logs(2.0, 0.5, 1.0)
    mask = torch.tensor([[1, 1, 0]])
    _, stats = policy_loss(logprobs, torch.zeros(1, 3), torch.tensor([1.0]), mask)
    # valid ratios 2.0 and 0.5; old - new = [-log 2, log 2] -> mean 0.
    assert float(stats["ratio_mean"]) == pytest.approx(1.25)
    assert float(stats["ratio_max"]) == pytest.approx(2.0)
    assert float(stats["approx_kl"]) == pytest.approx(0.0, abs=1e-7)
    # A>0: r=2.0 above 1.2 is clipped, r=0.5 is not.
    assert float(stats["clip_fraction"]) == pytest.approx(0.5)
    assert all(v.dim() == 0 and not v.requires_grad for v in stats.values())


def test_bf16_inputs_give_fp32_loss():
    logprobs = torch.full((2, 3), -1.0, dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(logprobs, logprobs.detach(), torch.tensor([1.0, 1.0]), torch.ones(2, 3))
    assert loss.dtype == torch.float32
    loss.backward()
    assert logprobs.grad.dtype == torch.bfloat16


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_empty_mask_raises_for_mean_aggregations(aggregation):
    with pytest.raises(ValueError, match="mask selects no tokens"):
        policy_loss(
            torch.zeros(2, 3),
            torch.zeros(2, 3),
            torch.ones(2),
            torch.zeros(2, 3),
            aggregation=aggregation,
        )


def test_empty_mask_with_token_sum_gives_zero_and_backprops():
    logprobs = torch.zeros(2, 3, requires_grad=True)
    loss, stats = policy_loss(
        logprobs,
        torch.zeros(2, 3),
        torch.ones(2),
        torch.zeros(2, 3),
        aggregation="seq-mean-token-sum",
    )
    assert float(loss.detach()) == 0.0
    loss.backward()
    assert torch.equal(logprobs.grad, torch.zeros(2, 3))
    assert float(stats["clip_fraction"]) == 0.0


def test_unknown_aggregation_lists_the_valid_ones():
    with pytest.raises(ValueError, match="unknown aggregation 'sum'") as info:
        policy_loss(
            torch.zeros(1, 2), torch.zeros(1, 2), torch.ones(1), torch.ones(1, 2), aggregation="sum"
        )
    assert all(name in str(info.value) for name in AGGREGATIONS)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (
            {"old_logprobs": torch.zeros(2, 4)},
            r"logprobs has shape \[2, 3\] but old_logprobs has shape \[2, 4\]",
        ),
        ({"mask": torch.ones(3, 3)}, r"logprobs has shape \[2, 3\] but mask has shape \[3, 3\]"),
        ({"advantages": torch.ones(3)}, r"advantages shape \[3\]"),
        ({"is_weights": torch.ones(2)}, r"is_weights has shape \[2\]"),
        ({"clip_eps": -0.1}, "clip_eps must be in"),
        ({"clip_eps_high": -0.1}, "clip_eps_high must be >= 0"),
    ],
)
def test_bad_arguments_are_named(kwargs, match):
    args = {
        "logprobs": torch.zeros(2, 3),
        "old_logprobs": torch.zeros(2, 3),
        "advantages": torch.ones(2),
        "mask": torch.ones(2, 3),
    }
    extra = {k: kwargs.pop(k) for k in list(kwargs) if k not in args}
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        policy_loss(
            args["logprobs"], args["old_logprobs"], args["advantages"], args["mask"], **extra
        )


def test_logprobs_must_be_2d():
    with pytest.raises(ValueError, match=r"logprobs must be 2-D"):
        policy_loss(torch.zeros(3), torch.zeros(3), torch.ones(3), torch.ones(3))


# ---------------------------------------------------------------------- kl_k3


def test_k3_hand_values():
    logp = torch.tensor([[0.0, 0.0, -2.0]])
    ref = torch.tensor([[1.0, -1.0, -2.0]])
    # d = ref - logp = [1, -1, 0]: e - 1 - 1, 1/e + 1 - 1, 0.
    expected = torch.tensor([[math.e - 2.0, math.exp(-1.0), 0.0]])
    torch.testing.assert_close(kl_k3(logp, ref), expected)


def test_k3_is_nonnegative_and_zero_when_equal():
    g = torch.Generator().manual_seed(1)
    logp = -torch.rand(4, 64, generator=g) * 5
    ref = logp + torch.randn(4, 64, generator=g) * 1e-3  # close values stress rounding
    assert (kl_k3(logp, ref) >= 0).all()
    assert torch.equal(kl_k3(logp, logp), torch.zeros(4, 64))


def test_k3_mask_zeroes_padding_even_with_garbage():
    logp = torch.tensor([[0.0, 1e4]], requires_grad=True)
    ref = torch.tensor([[1.0, -1e4]])
    kl = kl_k3(logp, ref, mask=torch.tensor([[1, 0]]))
    torch.testing.assert_close(kl, torch.tensor([[math.e - 2.0, 0.0]]))
    kl.sum().backward()
    # d/dlogp [exp(ref - logp) - (ref - logp) - 1] = 1 - exp(ref - logp)
    torch.testing.assert_close(logp.grad, torch.tensor([[1.0 - math.e, 0.0]]))


def test_k3_shape_mismatch():
    with pytest.raises(
        ValueError, match=r"logprobs has shape \[2\] but ref_logprobs has shape \[3\]"
    ):
        kl_k3(torch.zeros(2), torch.zeros(3))


# ---------------------------------------------------------------- masked_mean


def test_masked_mean_hand_values():
    x = torch.tensor([[1.0, 2.0, 100.0], [4.0, float("nan"), float("inf")]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor((1.0 + 2.0 + 4.0) / 3))
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.5, 4.0]))


def test_masked_mean_empty_rows_and_empty_mask():
    x = torch.ones(2, 2)
    mask = torch.tensor([[1, 1], [0, 0]])
    torch.testing.assert_close(masked_mean(x, mask, dim=1), torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="mask selects no tokens"):
        masked_mean(x, torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"x has shape \[2, 2\] but mask has shape \[2\]"):
        masked_mean(x, torch.ones(2))


def test_sequence_level_ratio_hand_computed():
    """GSPO: s_i = exp(mean_t(logp - old)) per sequence, clipped as a whole, per-sequence mean."""
    from rl_engine.algorithms import policy_loss

    mask = torch.tensor([[1, 1, 0], [1, 1, 1]], dtype=torch.bool)
    old = torch.zeros(2, 3)
    # row 0: log-ratios 0.1, 0.3 -> s_0 = exp(0.2); row 1: 0.0, -0.3, 0.0 -> s_1 = exp(-0.1)
    new = torch.tensor([[0.1, 0.3, 5.0], [0.0, -0.3, 0.0]], requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    loss, stats = policy_loss(
        new, old, adv, mask, clip_eps=0.1, aggregation="seq-mean-token-mean", ratio_level="sequence"
    )
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    # row 0: A > 0, s_0 > 1.1 -> clipped term 1.1 * 1 is the min; row 1: A < 0, s_1 = 0.905 in
    # the band [0.9, 1.1] -> both terms equal -2 s_1.
    term0 = -min(s0 * 1.0, 1.1 * 1.0)
    term1 = -min(s1 * -2.0, min(max(s1, 0.9), 1.1) * -2.0)
    torch.testing.assert_close(loss, torch.tensor((term0 + term1) / 2))
    loss.backward()
    # row 0 is clipped: no gradient; row 1: d/dlogp_t of -A s_1 / 2 = -(-2) s_1 / 3 / 2 per token
    expected = torch.tensor([[0.0, 0.0, 0.0], [s1 / 3, s1 / 3, s1 / 3]])
    torch.testing.assert_close(new.grad, expected)
    assert stats["clip_fraction"].item() == pytest.approx(2 / 5)


def test_token_and_sequence_ratios_agree_on_one_token_sequences():
    from rl_engine.algorithms import policy_loss

    new, old = torch.tensor([[0.3], [-0.2]]), torch.zeros(2, 1)
    mask, adv = torch.ones(2, 1, dtype=torch.bool), torch.tensor([1.0, -1.0])
    token, _ = policy_loss(new, old, adv, mask, ratio_level="token")
    seq, _ = policy_loss(new, old, adv, mask, ratio_level="sequence")
    assert torch.equal(token, seq)
    with pytest.raises(ValueError, match="unknown ratio_level"):
        policy_loss(new, old, adv, mask, ratio_level="group")
