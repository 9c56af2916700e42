"""DPPO, Divergence Proximal Policy Optimization ("Rethinking the Trust Region in LLM Reinforcement
Learning", arXiv 2602.04879): ``policy_loss_type=dppo``, set by ``trainer.algorithm.dppo.*``.

PPO keeps the update in a trust region by clipping the ratio ``r = pi / mu``; DPPO instead drops
(loss 0, no gradient) the tokens whose *probability* moved too far from the behaviour policy ``mu``
in the direction the advantage pushes it, and trains the others on the unclipped surrogate
``-A r``. ``mu`` is the rollout engine's policy (its logprobs of the sampled tokens) when they are
given, else the old policy (`compute_policy_loss` passes the anchor, see ``ROLLOUT_PREFERRED``).
With ``p = exp(logp)`` and ``m = exp(logp_mu)`` of the sampled token:

- ``binary_tv`` (total variation of the sampled token's Bernoulli): a token with ``A > 0`` is dropped
  when ``p - m > delta_high``, one with ``A < 0`` when ``m - p > delta_low``;
- ``binary_kl``: ``KL(Bern(m) || Bern(p)) = m log(m / p) + (1 - m) log((1 - m + e) / (1 - p + e))``
  (``e = 1e-8``); a token with ``A > 0`` and ``p > m`` is dropped when it exceeds ``delta_high``, one
  with ``A < 0`` and ``p < m`` when it exceeds ``delta_low``.

Tokens with ``A = 0`` are never dropped (their loss is 0 anyway). ``clip_frac`` is the share of
valid tokens dropped.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skylift.algorithms.loss_settings import DPPOSettings, PolicyLossSettings
from skylift.algorithms.policy_loss import LossAndMetrics, LossInputs, register_loss_rule

DPPO_TYPES = ("binary_tv", "binary_kl")
KL_EPS = 1e-8
"""Added to both ``1 - p`` terms of the binary KL so that ``p = 1`` stays finite."""


def dppo_dropped(logprobs: Tensor, mu_logprobs: Tensor, advantages: Tensor, config: DPPOSettings) -> Tensor:
    """The tokens DPPO drops (boolean, no gradient), see the module's docstring."""
    with torch.no_grad():
        logp, logm = logprobs.detach(), mu_logprobs.detach()
        p, m = torch.exp(logp), torch.exp(logm)
        moved = p - m
        up, down = advantages > 0, advantages < 0
        if config.dppo_type == "binary_tv":
            return (up & (moved > config.delta_high)) | (down & (-moved > config.delta_low))
        kl = m * (logm - logp) + (1 - m) * torch.log((1 - m + KL_EPS) / (1 - p + KL_EPS))
        return (up & (moved > 0) & (kl > config.delta_high)) | (down & (moved < 0) & (kl > config.delta_low))


@register_loss_rule("dppo")
def dppo_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """``-A r`` on the tokens DPPO keeps, 0 on those it drops (`old_logprobs` is the anchor ``mu``)."""
    dropped = dppo_dropped(x.logprobs, x.old_logprobs, x.advantages, config.dppo)
    loss = torch.where(dropped, torch.zeros_like(x.ratio), -x.advantages * x.ratio)
    return loss, x.metrics(clip_frac=dropped)
