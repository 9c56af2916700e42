"""Per-token KL estimators between the policy and the reference model, and the KL-in-reward penalty.

With ``d_t = logp_t - logp_ref_t`` (log-probabilities of the sampled token):

- ``k1``: ``d_t``, unbiased estimate of KL(policy || ref), can be negative;
- ``k2``: ``0.5 * d_t**2``, biased, always >= 0;
- ``k3``: ``exp(-d_t) + d_t - 1``, unbiased and always >= 0 (Schulman's low-variance estimator).

Two uses:

- as a loss term (``use_kl_loss``): add ``coef * compute_kl(...)`` to the per-token policy loss and
  reduce the sum with `skylift.algorithms.reductions.reduce_loss`;
- as a reward penalty (``use_kl_in_reward``): `apply_kl_penalty` subtracts ``coef * kl_t`` from every
  valid token's reward before the advantages are computed (the penalty carries no gradient).

The reward penalty's coefficient comes from a controller (``kl_ctrl.type``): `FixedKLController`
keeps it, `AdaptiveKLController` (Ziegler et al. 2019, arXiv:1909.08593, as in verl)
moves it after every step towards the coefficient that keeps the batch's KL at a target.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch

from skylift.algorithms.reductions import masked_mean

KLEstimator = Literal["k1", "k2", "k3"]
KL_ESTIMATORS: tuple[str, ...] = get_args(KLEstimator)

K3_LOG_RATIO_CLAMP = 20.0
"""`k3` clamps ``d_t`` to +-this before exponentiating, so that a very unlikely token gives a large
finite value instead of inf (exp(20) ~ 4.9e8)."""


def compute_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token KL estimate, same shape as `logprobs` (not masked: reduce it with the loss mask)."""
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs shape {tuple(logprobs.shape)} != ref_logprobs shape {tuple(ref_logprobs.shape)}"
        )
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    if estimator == "k3":
        d = log_ratio.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        return torch.exp(-d) + d - 1.0
    raise ValueError(f"unknown KL estimator {estimator!r}; known: {', '.join(KL_ESTIMATORS)}")


def apply_kl_penalty(
    token_level_rewards: torch.Tensor,
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    coef: float,
    estimator: str = "k1",
) -> tuple[torch.Tensor, dict[str, float]]:
    """KL-in-reward: ``reward_t - coef * kl_t`` on valid tokens (masked tokens keep their reward).

    Returns the penalised rewards (detached from any graph) and metrics: ``kl`` (mean per-token KL over
    valid tokens) and ``kl_coef``.
    """
    if token_level_rewards.shape != logprobs.shape:
        raise ValueError(
            f"token_level_rewards shape {tuple(token_level_rewards.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )
    if response_mask.shape != logprobs.shape:
        raise ValueError(
            f"response_mask shape {tuple(response_mask.shape)} != logprobs shape {tuple(logprobs.shape)}"
        )
    with torch.no_grad():
        kl = compute_kl(logprobs.detach(), ref_logprobs.detach(), estimator).to(token_level_rewards.dtype)
        mask = response_mask.to(token_level_rewards.dtype)
        kl = torch.where(mask != 0, kl * mask, torch.zeros_like(kl))
        rewards = token_level_rewards.detach() - coef * kl
        seq_mean = masked_mean(kl, mask, dim=-1)  # [batch]: each sequence's mean KL per token
        metrics = {
            "kl": float(masked_mean(kl, mask).item()),
            "kl_seq_mean": float(seq_mean.mean().item()),
            "kl_coef": float(coef),
        }
    return rewards, metrics


KLCtrlType = Literal["fixed", "adaptive"]
KL_CTRL_TYPES: tuple[str, ...] = get_args(KLCtrlType)

ADAPTIVE_KL_MAX_ERROR = 0.2
"""`AdaptiveKLController` clips the relative KL error ``kl / target - 1`` to +-this."""


class KLController(Protocol):
    """The KL-in-reward coefficient of the next step (`value`), updated after each step."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        """Feed one step's KL (mean over sequences of each one's mean per-token KL) and the number
        of sequences it was measured on."""
        ...


@dataclass
class FixedKLController:
    """A constant coefficient."""

    value: float

    def update(self, current_kl: float, n_steps: int) -> None:
        del current_kl, n_steps  # a fixed coefficient ignores the measured KL


@dataclass
class AdaptiveKLController:
    """Proportional control of the coefficient towards a target KL.

    ``error = clip(current_kl / target - 1, -0.2, 0.2)``, then
    ``value *= 1 + error * n_steps / horizon``: a KL above the target raises the coefficient, one
    below lowers it, by at most 20% of ``n_steps / horizon`` per update.
    """

    value: float
    target: float
    horizon: int

    def __post_init__(self) -> None:
        if self.target <= 0:
            raise ValueError(f"the adaptive KL controller needs a target > 0, got {self.target}")
        if self.horizon <= 0:
            raise ValueError(f"the adaptive KL controller needs a horizon > 0, got {self.horizon}")

    def update(self, current_kl: float, n_steps: int) -> None:
        error = min(max(current_kl / self.target - 1.0, -ADAPTIVE_KL_MAX_ERROR), ADAPTIVE_KL_MAX_ERROR)
        self.value *= 1.0 + error * n_steps / self.horizon


def make_kl_controller(kind: str, init_coef: float, target: float, horizon: int) -> KLController:
    """The controller named `kind` (``fixed`` | ``adaptive``) starting at `init_coef`."""
    if kind == "fixed":
        return FixedKLController(init_coef)
    if kind == "adaptive":
        return AdaptiveKLController(init_coef, target, horizon)
    raise ValueError(f"unknown KL controller {kind!r}; known: {', '.join(KL_CTRL_TYPES)}")
