"""Decoupled PPO (asynchronous RL) against a hand-computed example: one sequence of three tokens.

The behaviour policy (the engine, versions old) gave logprobs b, the proximal policy (the
trainer before the update) p, the policy being trained l; advantage A = 1.5, clip 0.2:

    w_t = exp(p_t - b_t)                    the behaviour weight (TIS caps it at C; MIS drops it)
    r_t = exp(l_t - p_t)                    the ratio, clipped around the proximal
    loss = mean_t -w_t min(r_t A, clip(r_t, 0.8, 1.2) A)

Every expected figure below is worked out with `math` on Python floats, apart from the code.
The control: without the decoupling, mode 'none' weighs every token 1 (the synchronous loss).
"""

from __future__ import annotations

import math

import pytest
import torch

from rl_engine.algorithms import policy_loss, rollout_correction
from rl_engine.config import AlgorithmConfig
from rl_engine.executors.worker.batch import TrainBatch
from rl_engine.executors.worker.policy.step_loss import Corrected, micro_loss

BEHAVIOUR = [-1.0, -2.0, -0.5]
PROXIMAL = [-0.5, -2.5, -0.5]  # weights exp(0.5), exp(-0.5), 1
CURRENT = [-0.2, -2.5, -0.9]  # ratios exp(0.3) (clipped at 1.2), 1, exp(-0.4) (unclipped: A > 0)
ADVANTAGE, EPS = 1.5, 0.2


def _hand_loss(weights: list[float]) -> float:
    terms = []
    for w, now, prox in zip(weights, CURRENT, PROXIMAL):
        r = math.exp(now - prox)
        clipped = min(max(r, 1 - EPS), 1 + EPS)
        terms.append(-w * min(r * ADVANTAGE, clipped * ADVANTAGE))
    return sum(terms) / len(terms)


def _row(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


def _loss(mode: str, threshold: float = 2.0, decoupled: bool = True) -> float:
    mask = torch.ones(1, 3, dtype=torch.bool)
    correction = rollout_correction(
        _row(PROXIMAL),
        _row(BEHAVIOUR),
        mask,
        mode=mode,
        threshold=threshold,
        decoupled=decoupled,
    )
    loss, _ = policy_loss(
        _row(CURRENT),
        _row(PROXIMAL),
        torch.tensor([ADVANTAGE]),
        correction.mask,
        clip_eps=EPS,
        is_weights=correction.weights,
    )
    return float(loss)


def test_the_plain_behaviour_weight():
    weights = [math.exp(0.5), math.exp(-0.5), 1.0]
    assert _loss("none") == pytest.approx(_hand_loss(weights), rel=1e-6)


def test_truncated_importance_sampling_caps_the_behaviour_weight():
    weights = [min(math.exp(0.5), 1.5), math.exp(-0.5), 1.0]  # C = 1.5 caps the first
    assert _loss("token_truncate", threshold=1.5) == pytest.approx(_hand_loss(weights), rel=1e-6)


def test_masked_importance_sampling_drops_a_weight_outside_the_band():
    # C = 1.5: exp(0.5) = 1.65 and exp(-0.5) = 0.61 leave [1/1.5, 1.5]; the mean is over the one kept
    expected = _hand_loss([0.0, 0.0, 1.0]) * 3 / 1
    assert _loss("token_mask", threshold=1.5) == pytest.approx(expected, rel=1e-6)


def test_without_the_decoupling_none_weighs_every_token_one():
    assert _loss("none", decoupled=False) == pytest.approx(_hand_loss([1.0] * 3), rel=1e-6)
    assert _loss("none", decoupled=False) != pytest.approx(_loss("none"), rel=1e-3)


def test_the_worker_loss_of_a_stale_micro_batch_is_decoupled_ppo():
    """micro_loss with the step's Corrected: the trainer's loss equals the hand-computed one."""
    batch = TrainBatch(
        input_ids=torch.tensor([[5, 6, 7, 8]]),
        attention_mask=torch.ones(1, 4, dtype=torch.long),
        response_mask=torch.ones(1, 3, dtype=torch.bool),
        rollout_logprobs=_row(BEHAVIOUR),
        advantages=torch.tensor([ADVANTAGE]),
        rewards=torch.tensor([1.0]),
    )
    algo = AlgorithmConfig(clip_eps=EPS, rollout_correction="none")
    corrected = Corrected.of(algo, batch, _row(PROXIMAL), decoupled=True)
    loss, _ = micro_loss(algo, batch, _row(CURRENT), None, units=3.0, scale=1, corrected=corrected)
    weights = [math.exp(0.5), math.exp(-0.5), 1.0]
    assert float(loss) == pytest.approx(_hand_loss(weights), rel=1e-6)
