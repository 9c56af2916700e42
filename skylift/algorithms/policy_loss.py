"""Policy losses (`regular`, `dual_clip`, `gspo`, `cispo`, `sapo`, `rollout_is`; `clip_cov` and
`kl_cov` in `skylift.algorithms.covariance_losses`, `dppo` in `skylift.algorithms.divergence_losses`)
behind a registry users can extend.

Every loss takes `[batch, response_len]` tensors: ``logprobs`` (current policy, with gradient),
``old_logprobs`` (the policy that is being optimised away from, usually the trainer's logprobs before
this step's updates), ``advantages`` and ``response_mask``, plus the ``trainer.algorithm`` group as
it is (`skylift.algorithms.loss_settings.PolicyLossSettings`: SkyRL's nested names). It returns the
**per-token** loss (0 on masked positions) and a dict of float metrics computed over the valid tokens;
`skylift.algorithms.reductions.reduce_loss` turns the per-token loss into the scalar to backpropagate.

With ``r_t = exp(logp_t - old_logp_t)`` and advantage ``A_t``:

- ``regular`` (PPO clip): ``max(-A r, -A clip(r, 1 - eps_clip_low, 1 + eps_clip_high))``;
- ``dual_clip``: as ``regular``, and for ``A < 0`` the loss is also capped at ``-A * clip_ratio_c``
  (``clip_ratio_c > 1``), so a huge ratio on a bad token cannot blow the update up;
- ``gspo`` (Group Sequence Policy Optimization): the sequence ratio
  ``s_i = exp(mean over valid t of (logp_t - old_logp_t))`` (geometric mean of the token ratios)
  replaces ``r_t`` in the PPO clip. Per token it is written ``sg(s_i) * exp(logp_t - sg(logp_t))``,
  equal to ``s_i`` in value, whose gradient averaged over a sequence's tokens is the gradient of
  ``s_i`` (GSPO-token form). Reduce it with ``sequence_mean`` to get the paper's objective;
- ``cispo``: ``-sg(clip(r, 1 - cispo.cispo_eps_clip_low, 1 + cispo.cispo_eps_clip_high)) * A * logp``:
  every token keeps a gradient, with its importance weight clipped and not differentiated. CISPO has its
  own bounds (default 0 and 5: the weight is kept at or above 1 - 0 and capped at 1 + 5), the PPO
  ones do not apply to it;
- ``sapo`` (Soft Adaptive Policy Optimization, arXiv 2511.20347): ``-A * (4 / tau) * sigmoid(tau (r - 1))``
  with ``tau = sapo.tau_pos`` where ``A > 0``, else ``sapo.tau_neg``: a smooth gate instead of the
  hard clip, whose gradient at ``r = 1`` equals PPO's and fades as ``r`` leaves 1 (SAPO's paper
  reduces it with ``sequence_mean``);
- ``rollout_is``: ``-sg(r') * A * logp`` with ``r' = exp(logp - rollout_logp)`` where it lies strictly
  inside ``(1 - eps_clip_low, 1 + eps_clip_high)`` and 0 elsewhere: anchored on the engine's logprobs
  of the sampled tokens instead of ``old_logprobs`` (`ROLLOUT_ANCHORED`; they are required);
- ``dppo``: ``-A r`` with ``r`` taken against the rollout logprobs when given, else ``old_logprobs``
  (`ROLLOUT_PREFERRED`), and the tokens whose probability moved past ``dppo.delta_low/high`` in the
  advantage's direction dropped (`skylift.algorithms.divergence_losses`).

Off-policy corrections (``off_policy_correction``, `skylift.algorithms.off_policy`: truncated importance
sampling per token or per sequence, outlier/token/sequence masks) compare ``old_logprobs`` with the
engine's ``rollout_logprobs`` and reweight or mask every per-token loss. ``use_tis`` with
``tis_imp_ratio_cap`` is the older spelling of token TIS: every per-token loss is multiplied by
``sg(min(exp(old_logp - rollout_logp), cap))``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Protocol

import torch
from torch import Tensor

from skylift.algorithms.loss_settings import PolicyLossSettings, legacy_token_tis_cap
from skylift.algorithms.off_policy import apply_off_policy_correction, corrections_enabled
from skylift.algorithms.reductions import masked_mean, masked_sum
from skylift.algorithms.supervised import cross_entropy
from skylift.utils.registry import POLICY_LOSS_REGISTRY, Registry

LossAndMetrics = tuple[Tensor, dict[str, float]]
"""What a policy loss returns: the per-token loss and float metrics."""

LOG_RATIO_CLAMP = 20.0
"""Log-ratios are clamped to +-this before `exp`, so the ratio stays finite (exp(20) ~ 4.9e8)."""


class PolicyLoss(Protocol):
    """A policy loss: returns (per-token loss, metrics)."""

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        response_mask: torch.Tensor,
        config: PolicyLossSettings,
    ) -> tuple[torch.Tensor, dict[str, float]]: ...


_LOSSES: Registry[PolicyLoss] = POLICY_LOSS_REGISTRY

ROLLOUT_ANCHORED = {"rollout_is"}
"""Losses whose ratio is taken against the rollout engine's logprobs: `compute_policy_loss` hands
them ``rollout_logprobs`` as their ``old_logprobs``."""

ROLLOUT_PREFERRED = {"dppo"}
"""Losses whose ratio is taken against the rollout engine's logprobs when they are given, else
against ``old_logprobs``."""


def register_policy_loss(name: str, *, override: bool = False) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator registering a policy loss under `name` (`override=True` to replace one)."""
    return _LOSSES.register(name, override=override)


def unregister_policy_loss(name: str) -> None:
    """Remove the policy loss registered as `name`."""
    _LOSSES.unregister(name)


def get_policy_loss(name: str) -> PolicyLoss:
    """The policy loss registered as `name`; an unknown name raises an error listing the known ones."""
    return _LOSSES.get(name)


def policy_loss_names() -> list[str]:
    """Names of all registered policy losses."""
    return _LOSSES.names()


@dataclass(frozen=True)
class LossInputs:
    """A policy loss's arguments (`PolicyLoss`) as one value, with the clamped per-token log-ratio to
    `old_logprobs` and the ratio, each taken once."""

    logprobs: Tensor
    old_logprobs: Tensor
    advantages: Tensor
    response_mask: Tensor
    config: PolicyLossSettings

    @cached_property
    def log_ratio(self) -> Tensor:
        return (self.logprobs - self.old_logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)

    @cached_property
    def ratio(self) -> Tensor:
        return torch.exp(self.log_ratio)

    def metrics(self, **fractions: Tensor) -> dict[str, float]:
        """Each named boolean tensor's fraction of valid tokens, then the ratio metrics."""
        return _metrics(self.response_mask, self.ratio, self.log_ratio, **fractions)


LossRule = Callable[[LossInputs, PolicyLossSettings], LossAndMetrics]
"""A policy loss's rule: its `LossInputs` and settings (`LossInputs.config`, apart so that what a
rule reads of them is visible) to (per-token loss, metrics)."""


def policy_loss_from(rule: LossRule) -> PolicyLoss:
    """`rule` as a `PolicyLoss`: the loss takes `PolicyLoss`'s arguments (positional or by name)
    and hands them to `rule` as one `LossInputs`, with its settings."""

    def loss(*arguments: Any, **named: Any) -> LossAndMetrics:
        inputs = LossInputs(*arguments, **named)
        return rule(inputs, inputs.config)

    loss.__name__ = loss.__qualname__ = getattr(rule, "__name__", "policy_loss")
    loss.__doc__ = rule.__doc__
    return loss


def register_loss_rule(name: str) -> Callable[[LossRule], PolicyLoss]:
    """Decorator registering `rule` as the policy loss `name` (see `policy_loss_from`); returns the
    registered loss."""

    def decorator(rule: LossRule) -> PolicyLoss:
        loss = policy_loss_from(rule)
        register_policy_loss(name)(loss)
        return loss

    return decorator


def compute_policy_loss(
    name: str,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    config: PolicyLossSettings,
    rollout_logprobs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token loss and metrics of the loss registered as `name` under the settings `config` (the
    ``trainer.algorithm`` group), with its off-policy corrections (``config.off_policy_correction``,
    and ``use_tis`` / ``tis_imp_ratio_cap``).

    The per-token loss is 0 on masked positions. Metrics (over valid tokens): ``clip_frac``,
    ``ppo_kl`` (mean of ``old_logp - logp``), ``ratio_mean``/``ratio_min``/``ratio_max``, loss-specific
    ones, and those of the corrections (``tis_weight_mean``/``tis_clip_frac`` with token TIS).
    """
    shape = logprobs.shape
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [batch, response_len], got shape {tuple(shape)}")
    for arg, tensor in (
        ("old_logprobs", old_logprobs),
        ("advantages", advantages),
        ("response_mask", response_mask),
    ):
        if tensor.shape != shape:
            raise ValueError(f"{arg} shape {tuple(tensor.shape)} != logprobs shape {tuple(shape)}")
    loss_fn = get_policy_loss(name)
    mask = response_mask.to(logprobs.dtype)
    # Masked positions may hold anything (padding, -inf): zero them first so that neither the loss
    # nor its gradient can pick up NaN/inf from them.
    valid = mask != 0
    logprobs = torch.where(valid, logprobs, torch.zeros_like(logprobs))
    old_logprobs = torch.where(valid, old_logprobs.detach(), torch.zeros_like(logprobs))
    advantages = torch.where(valid, advantages.detach(), torch.zeros_like(logprobs))
    corrections, token_tis_cap = config.off_policy_correction, legacy_token_tis_cap(config)
    needs_rollout = corrections_enabled(corrections, token_tis_cap) or name in ROLLOUT_ANCHORED
    if needs_rollout and rollout_logprobs is None:
        what = f"policy loss {name!r}" if name in ROLLOUT_ANCHORED else "an off-policy correction"
        raise ValueError(f"{what} needs the rollout engine's logprobs, but rollout_logprobs were not given")
    if rollout_logprobs is not None and rollout_logprobs.shape != shape:
        if needs_rollout:
            raise ValueError(
                f"rollout_logprobs shape {tuple(rollout_logprobs.shape)} != logprobs shape {tuple(shape)}"
            )
        rollout_logprobs = None  # not read by this loss
    if rollout_logprobs is not None:
        rollout_logprobs = torch.where(valid, rollout_logprobs.detach(), torch.zeros_like(logprobs))
    on_rollout = name in ROLLOUT_ANCHORED or name in ROLLOUT_PREFERRED
    anchor = rollout_logprobs if on_rollout and rollout_logprobs is not None else old_logprobs
    loss, metrics = loss_fn(logprobs, anchor, advantages, mask, config)
    if rollout_logprobs is not None:
        loss, correction_metrics = apply_off_policy_correction(
            loss, old_logprobs, rollout_logprobs, mask, corrections, token_tis_cap
        )
        metrics.update(correction_metrics)
    loss = torch.where(mask != 0, loss * mask, torch.zeros_like(loss))
    return loss, metrics


def _mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float(masked_mean(values.detach(), mask).item())


def _metrics(mask: Tensor, ratio: Tensor, log_ratio: Tensor, **fractions: Tensor) -> dict[str, float]:
    """Each named boolean tensor's fraction of valid tokens, then the ratio metrics."""
    metrics = {name: _mean(flags.to(mask.dtype), mask) for name, flags in fractions.items()}
    return metrics | _ratio_metrics(ratio, log_ratio.detach(), mask)


def _ratio_metrics(ratio: torch.Tensor, log_ratio: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    valid = mask != 0
    r = ratio.detach()
    has_valid = bool(valid.any())
    return {
        "ppo_kl": _mean(-log_ratio, mask),
        "ratio_mean": _mean(r, mask),
        "ratio_min": float(r[valid].min().item()) if has_valid else 1.0,
        "ratio_max": float(r[valid].max().item()) if has_valid else 1.0,
    }


def _ppo_clip(
    ratio: torch.Tensor, advantages: torch.Tensor, config: PolicyLossSettings
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped per-token loss and the indicator of tokens where the clipped term is active."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - config.eps_clip_low, 1.0 + config.eps_clip_high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped)


@register_loss_rule("regular")
def ppo_clip_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """PPO clipped surrogate, per token."""
    loss, clipped = _ppo_clip(x.ratio, x.advantages, config)
    return loss, x.metrics(clip_frac=clipped)


@register_loss_rule("dual_clip")
def dual_clip_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """Dual-clip PPO: PPO clip, then ``min(., -A * clip_ratio_c)`` where ``A < 0``."""
    ppo_loss, clipped = _ppo_clip(x.ratio, x.advantages, config)
    cap = -x.advantages * config.clip_ratio_c
    negative = x.advantages < 0
    dual_clipped = negative & (cap < ppo_loss)
    loss = torch.where(negative, torch.minimum(ppo_loss, cap), ppo_loss)
    return loss, x.metrics(clip_frac=clipped, dual_clip_frac=dual_clipped)


@register_loss_rule("gspo")
def gspo_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """GSPO: PPO clip on the sequence-level ratio (geometric mean of token ratios), GSPO-token form."""
    logprobs, response_mask = x.logprobs, x.response_mask
    token_log_ratio = logprobs - x.old_logprobs
    lengths = response_mask.sum(dim=-1).clamp(min=1)
    seq_log_ratio = masked_sum(token_log_ratio, response_mask, dim=-1) / lengths  # [batch]
    log_ratio = seq_log_ratio.detach().unsqueeze(-1) + logprobs - logprobs.detach()
    ratio = torch.exp(log_ratio.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    loss, clipped = _ppo_clip(ratio, x.advantages, config)
    return loss, _metrics(response_mask, ratio, token_log_ratio, clip_frac=clipped)


@register_loss_rule("cispo")
def cispo_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """CISPO: ``-sg(clip(r, 1 - cispo_eps_clip_low, 1 + cispo_eps_clip_high)) * A * logp``."""
    low, high = 1.0 - config.cispo.cispo_eps_clip_low, 1.0 + config.cispo.cispo_eps_clip_high
    r = x.ratio.detach()
    loss = -r.clamp(low, high) * x.advantages * x.logprobs
    return loss, x.metrics(clip_frac=(r < low) | (r > high))


@register_loss_rule("sapo")
def sapo_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """SAPO: ``-A * (4 / tau) * sigmoid(tau * (r - 1))``, ``tau`` by the advantage's sign."""
    ratio, sapo = x.ratio, config.sapo
    tau = torch.where(
        x.advantages > 0, torch.full_like(ratio, sapo.tau_pos), torch.full_like(ratio, sapo.tau_neg)
    )
    gate = torch.sigmoid(tau * (ratio - 1.0)) * (4.0 / tau)
    return -x.advantages * gate, x.metrics()


@register_loss_rule("rollout_is")
def rollout_is_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """``-sg(r') * A * logp``, ``r'`` the ratio to the rollout logprobs (given as `old_logprobs`, see
    `ROLLOUT_ANCHORED`) inside ``(1 - eps_clip_low, 1 + eps_clip_high)``, else 0."""
    r = x.ratio.detach()
    inside = (r > 1.0 - config.eps_clip_low) & (r < 1.0 + config.eps_clip_high)
    weight = torch.where(inside, r, torch.zeros_like(r))
    return -weight * x.advantages * x.logprobs, x.metrics(clip_frac=~inside)


@register_loss_rule("importance_sampling")
def importance_sampling_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """``-r * A`` with the unclipped ratio ``r`` to `old_logprobs` (``importance_sampling``, also
    Tinker's loss of that name; on-policy distillation trains with it)."""
    return -x.ratio * x.advantages, x.metrics()


@register_loss_rule("cross_entropy")
def cross_entropy_loss(x: LossInputs, config: PolicyLossSettings) -> LossAndMetrics:
    """``-logp`` of each response token, advantages unused: supervised fine-tuning on the sampled
    responses (``policy_loss_type=cross_entropy``)."""
    return cross_entropy(x.logprobs, torch.ones_like(x.logprobs)), x.metrics()
