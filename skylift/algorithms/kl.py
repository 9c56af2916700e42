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
"""

from __future__ import annotations

from typing import Literal, get_args

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
        metrics = {"kl": float(masked_mean(kl, mask).item()), "kl_coef": float(coef)}
    return rewards, metrics
