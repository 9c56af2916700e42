"""The Bradley-Terry loss of reward-model training (TRL's `RewardTrainer`).

Over pairs of rewards (``r_c`` of the chosen completion, ``r_r`` of the rejected one) and an
optional margin ``m`` per pair: ``-logsigmoid(r_c - r_r - m)``, plus, with a centring coefficient
``c``, ``c * (r_c + r_r)^2`` (which keeps the rewards near zero). The loss of a batch is the mean
over its pairs; `pair_losses` returns the per-pair terms so that a batch split over micro-batches
and ranks can add them up exactly.
"""

from __future__ import annotations

import torch
from torch import Tensor


def pair_losses(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_coefficient: float | None = None
) -> Tensor:
    """Each pair's loss `[n]` (see the module docstring)."""
    diff = chosen - rejected
    if margin is not None:
        diff = diff - margin.to(diff.dtype)
    loss = -torch.nn.functional.logsigmoid(diff)
    if center_coefficient is not None:
        loss = loss + center_coefficient * (chosen + rejected) ** 2
    return loss


def bradley_terry_loss(
    chosen: Tensor, rejected: Tensor, margin: Tensor | None = None, center_coefficient: float | None = None
) -> Tensor:
    """The mean of `pair_losses` (TRL's `RewardTrainer.compute_loss`)."""
    return pair_losses(chosen, rejected, margin, center_coefficient).mean()


__all__ = ["bradley_terry_loss", "pair_losses"]
