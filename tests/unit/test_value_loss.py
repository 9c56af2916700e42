"""The critic's clipped value loss against values computed by hand."""

from __future__ import annotations

import pytest
import torch

from skylift.algorithms import compute_value_loss


def test_clipped_value_loss_by_hand() -> None:
    values = torch.tensor([[1.0, 0.5, 3.0]], requires_grad=True)
    old = torch.tensor([[0.0, 0.4, 1.0]])
    returns = torch.tensor([[2.0, 0.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    per_token, metrics = compute_value_loss(values, old, returns, mask, clip=0.2)
    # token 0: v=1 -> (1-2)^2 = 1; clipped 0.2 -> (0.2-2)^2 = 3.24; max -> 3.24, half -> 1.62
    # token 1: v=0.5 -> 0.25; clipped 0.5 (within 0.4 +- 0.2) -> 0.25; half -> 0.125
    assert per_token[0].tolist() == pytest.approx([1.62, 0.125, 0.0])
    assert metrics["value_loss"] == pytest.approx((1.62 + 0.125) / 2)
    assert metrics["value_clip_frac"] == pytest.approx(0.5)
    per_token.sum().backward()
    # token 0 takes the clipped branch, which is constant in v: no gradient; token 1: v - R = 0.5
    assert values.grad is not None
    assert values.grad[0].tolist() == pytest.approx([0.0, 0.5, 0.0])


def test_unclipped_value_loss_is_half_squared_error() -> None:
    values = torch.tensor([[1.0, -1.0]])
    per_token, _ = compute_value_loss(
        values, torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]), torch.ones(1, 2), 0.0
    )
    assert per_token[0].tolist() == pytest.approx([0.5, 2.0])


def test_value_loss_shape_errors_are_named() -> None:
    with pytest.raises(ValueError, match="share one shape"):
        compute_value_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2, 2), torch.ones(2, 3))
