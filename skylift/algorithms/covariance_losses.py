"""Clip-Cov and KL-Cov policy losses ("The Entropy Mechanism of Reinforcement Learning for
Reasoning Language Models", arXiv 2505.22617), set by ``trainer.algorithm.clip_cov.*`` / ``kl_cov.*``.

Both pick tokens by the centred covariance of advantage and logprob over the valid tokens of the
batch the loss is called on (one micro-batch):
``cov_t = (A_t - mean(A)) * (logp_t - mean(logp))``, a constant (no gradient). Tokens with a large
covariance are those that drive the policy's entropy down; these losses restrain them.

- ``clip_cov``: the PPO clip loss (``eps_clip_low``/``eps_clip_high``), except that
  ``max(1, int(clip_cov.clip_ratio * N))`` tokens (``N`` valid tokens) are dropped (loss 0, no gradient),
  drawn uniformly at random (torch's global generator) among the valid tokens the PPO clip left
  alone whose covariance lies strictly inside ``(clip_cov.clip_cov_lb, clip_cov.clip_cov_ub)`` (all of them when fewer).
- ``kl_cov``: the unclipped surrogate ``-A r`` on every token, plus ``kl_cov.ppo_kl_coef * |log r|`` on
  the ``max(1, int(kl_cov.kl_cov_frac * N))`` valid tokens of largest covariance.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skylift.algorithms.loss_settings import PolicyLossSettings
from skylift.algorithms.policy_loss import LossAndMetrics, LossInputs, _ppo_clip, register_loss_rule
from skylift.algorithms.reductions import masked_mean


def token_covariance(advantages: Tensor, logprobs: Tensor, mask: Tensor) -> Tensor:
    """``(A - mean(A)) * (logp - mean(logp))`` per token, means over the valid tokens; no gradient."""
    with torch.no_grad():
        logp = logprobs.detach()
        return (advantages - masked_mean(advantages, mask)) * (logp - masked_mean(logp, mask))


@register_loss_rule("clip_cov")
def clip_cov_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """PPO clip with a random share of the mid-covariance unclipped tokens dropped."""
    loss, clipped = _ppo_clip(x.ratio, x.advantages, config)
    valid, settings = x.response_mask != 0, config.clip_cov
    with torch.no_grad():
        cov = token_covariance(x.advantages, x.logprobs, x.response_mask)
        candidates = valid & ~clipped & (cov > settings.clip_cov_lb) & (cov < settings.clip_cov_ub)
        count = max(int(settings.clip_ratio * int(valid.sum().item())), 1)
        flat = torch.nonzero(candidates.reshape(-1)).squeeze(-1)
        if flat.numel() > count:
            flat = flat[torch.randperm(flat.numel())[:count].to(flat.device)]
        dropped = torch.zeros(candidates.numel(), dtype=torch.bool, device=candidates.device)
        dropped[flat] = True
        dropped = dropped.reshape(candidates.shape)
    loss = torch.where(dropped, torch.zeros_like(loss), loss)
    return loss, x.metrics(clip_frac=clipped, cov_clip_frac=dropped)


@register_loss_rule("kl_cov")
def kl_cov_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """``-A r``, plus ``ppo_kl_coef * |log r|`` on the share of valid tokens of largest covariance."""
    loss = -x.advantages * x.ratio
    valid, settings = x.response_mask != 0, config.kl_cov
    with torch.no_grad():
        cov = token_covariance(x.advantages, x.logprobs, x.response_mask)
        n_valid = int(valid.sum().item())
        selected = torch.zeros_like(valid)
        if n_valid > 0:
            count = min(max(int(n_valid * settings.kl_cov_frac), 1), n_valid)
            ranked = torch.where(valid, cov, torch.full_like(cov, -torch.inf)).reshape(-1)
            selected.view(-1)[torch.topk(ranked, count).indices] = True
    loss = loss + torch.where(selected, settings.ppo_kl_coef * x.log_ratio.abs(), torch.zeros_like(loss))
    return loss, x.metrics(kl_cov_frac=selected)
