"""KL estimators, the KL loss term and the KL-in-reward penalty, checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from skylift.algorithms import (
    AdaptiveKLController,
    FixedKLController,
    apply_kl_penalty,
    compute_advantages,
    compute_kl,
    make_kl_controller,
    reduce_loss,
)

# d = logp - logp_ref = 0.5 and -1.0
LOGP = [[-1.0, -2.0]]
REF = [[-1.5, -1.0]]


def close(actual: torch.Tensor, expected: list, atol: float = 1e-6) -> None:
    torch.testing.assert_close(actual.detach(), torch.tensor(expected, dtype=actual.dtype), atol=atol, rtol=0)


@pytest.mark.parametrize(
    ("estimator", "expected", "grad"),
    [
        # k1 = d; d/dlogp = 1
        ("k1", [[0.5, -1.0]], [[1.0, 1.0]]),
        # k2 = 0.5 d^2 = 0.125, 0.5; d/dlogp = d
        ("k2", [[0.125, 0.5]], [[0.5, -1.0]]),
        # k3 = exp(-d) + d - 1: exp(-0.5) + 0.5 - 1 = 0.106531; exp(1) - 1 - 1 = 0.718282
        # d/dlogp = 1 - exp(-d): 1 - 0.606531 = 0.393469; 1 - 2.718282 = -1.718282
        ("k3", [[0.106531, 0.718282]], [[0.393469, -1.718282]]),
    ],
)
def test_kl_estimators_by_hand(estimator: str, expected: list, grad: list) -> None:
    logp = torch.tensor(LOGP, dtype=torch.float64, requires_grad=True)
    kl = compute_kl(logp, torch.tensor(REF, dtype=torch.float64), estimator)
    close(kl, expected)
    kl.sum().backward()
    close(logp.grad, grad)


def test_k3_is_finite_for_extreme_log_ratios() -> None:
    kl = compute_kl(torch.tensor([[-200.0, 0.0]]), torch.tensor([[0.0, -200.0]]), "k3")
    assert torch.isfinite(kl).all()
    assert (kl > 0).all()


def test_unknown_kl_estimator_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown KL estimator 'k4'; known: k1, k2, k3"):
        compute_kl(torch.zeros(1, 1), torch.zeros(1, 1), "k4")


def test_kl_loss_term_added_to_policy_loss() -> None:
    # use_kl_loss: per-token loss + coef * kl, reduced with token_mean over valid tokens.
    logp = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    policy = torch.tensor([[0.2, -0.4, 9.0]], dtype=torch.float64)
    loss = reduce_loss(policy + 0.1 * compute_kl(logp, ref, "k2"), mask, "token_mean")
    # (0.2 + 0.1*0.125 + -0.4 + 0.1*0.5) / 2 = (-0.2 + 0.0625) / 2 = -0.06875
    assert loss.item() == pytest.approx(-0.06875)
    loss.backward()
    # d/dlogp = 0.1 * d / 2 = 0.025, -0.05; masked token 0
    close(logp.grad, [[0.025, -0.05, 0.0]])


def test_kl_in_reward_penalises_valid_tokens_only() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0, -4.0]], requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, -1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    penalised, metrics = apply_kl_penalty(rewards, logp, ref, mask, coef=0.1, estimator="k1")
    # k1 = 0.5, -1.0 (third token masked): 0 - 0.1*0.5 = -0.05; 1 - 0.1*(-1) = 1.1; masked keeps 0
    close(penalised, [[-0.05, 1.1, 0.0]])
    assert not penalised.requires_grad
    assert metrics["kl"] == pytest.approx(-0.25)  # (0.5 - 1.0) / 2
    assert metrics["kl_coef"] == 0.1


def test_kl_in_reward_feeds_grpo_scores() -> None:
    # two responses of one prompt, outcome rewards 1 and 0 on their last token, k3 penalty coef 0.5
    rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0]])
    logp = torch.tensor([[-1.0, -2.0], [-1.0, -1.0]])
    ref = torch.tensor([[-1.5, -1.0], [-1.0, -1.0]])
    mask = torch.ones(2, 2)
    penalised, _ = apply_kl_penalty(rewards, logp, ref, mask, coef=0.5, estimator="k3")
    # row 0: k3 = 0.106531, 0.718282 -> rewards -0.053265, 1 - 0.359141 = 0.640859; score 0.587594
    # row 1: k3 = 0, 0 -> score 0.  mean 0.293797 -> advantages +-0.293797 (no std normalisation)
    adv, _ = compute_advantages("grpo", penalised, mask, group_ids=[0, 0], norm_by_std=False)
    close(adv, [[0.293797, 0.293797], [-0.293797, -0.293797]])
    assert math.isclose(penalised[0].sum().item(), 0.587594, abs_tol=1e-6)


def test_kl_penalty_reports_the_mean_of_per_sequence_means() -> None:
    # k1 = logp - ref: row 0 has valid tokens 1.0 and 0.5, row 1 one valid token 2.0
    logp = torch.zeros(2, 3)
    ref = torch.tensor([[-1.0, -0.5, -9.0], [-2.0, -9.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    _, metrics = apply_kl_penalty(torch.zeros(2, 3), logp, ref, mask, coef=0.1, estimator="k1")
    assert metrics["kl"] == pytest.approx(3.5 / 3)  # over the 3 valid tokens
    assert metrics["kl_seq_mean"] == pytest.approx((0.75 + 2.0) / 2)  # each row's mean, then the mean


def test_adaptive_kl_controller_moves_towards_the_target() -> None:
    ctrl = AdaptiveKLController(value=0.2, target=0.05, horizon=1000)
    # KL 10% above the target: error 0.1, 100 sequences -> value * (1 + 0.1 * 100 / 1000) = 0.2 * 1.01
    ctrl.update(current_kl=0.055, n_steps=100)
    assert ctrl.value == pytest.approx(0.202)
    # KL far above: the error is clipped to +0.2 -> * (1 + 0.2 * 500 / 1000) = * 1.1
    ctrl.update(current_kl=5.0, n_steps=500)
    assert ctrl.value == pytest.approx(0.202 * 1.1)
    # KL 0: error clipped to -0.2 -> * (1 - 0.2 * 500 / 1000) = * 0.9
    ctrl.update(current_kl=0.0, n_steps=500)
    assert ctrl.value == pytest.approx(0.202 * 1.1 * 0.9)
    # KL at the target: unchanged
    before = ctrl.value
    ctrl.update(current_kl=0.05, n_steps=500)
    assert ctrl.value == pytest.approx(before)


def test_fixed_kl_controller_and_factory() -> None:
    fixed = make_kl_controller("fixed", 0.3, target=0.1, horizon=10)
    assert isinstance(fixed, FixedKLController)
    fixed.update(current_kl=100.0, n_steps=1000)
    assert fixed.value == 0.3
    adaptive = make_kl_controller("adaptive", 0.3, target=0.1, horizon=10)
    assert isinstance(adaptive, AdaptiveKLController)
    adaptive.update(current_kl=0.08, n_steps=5)  # error -0.2 (0.08 / 0.1 - 1) -> * (1 - 0.2 * 5 / 10)
    assert adaptive.value == pytest.approx(0.3 * 0.9)
    with pytest.raises(ValueError, match="unknown KL controller 'pid'"):
        make_kl_controller("pid", 0.3, target=0.1, horizon=10)
    with pytest.raises(ValueError, match="target > 0"):
        AdaptiveKLController(value=0.1, target=0.0, horizon=10)
    with pytest.raises(ValueError, match="horizon > 0"):
        AdaptiveKLController(value=0.1, target=0.1, horizon=0)
