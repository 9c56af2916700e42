"""The Tinker loss functions, evaluated on padded `[batch, tokens]` tensors.

Every loss is a **sum** over tokens and data (no normalisation: the client chooses weights and
advantages), so gradients of chunks sent separately add up to the gradient of the whole batch.

- ``cross_entropy``: ``-sum(logp[target] * weights)``; weights may be any real number.
- ``importance_sampling``: ``-sum(exp(logp - sampling_logp) * advantages)``.
- ``ppo``: ``-sum(min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A))``.
- ``cispo``: ``-sum(sg(clip(r, low, high)) * A * logp)``.

``r = exp(logp - sampling_logp)`` with the ``logprobs`` input as sampling logprobs. The clip
thresholds come from ``loss_fn_config`` (defaults 0.8 and 1.2). PPO and CISPO use
`skylift.algorithms.compute_policy_loss` (``regular`` and ``cispo``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from skylift.algorithms import PolicyLossConfig, compute_policy_loss
from skylift.tinker.errors import UserError

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2

# (logprobs [B,T], inputs name -> [B,T], mask [B,T], config) -> (per-token loss [B,T], metrics)
LossImpl = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor], torch.Tensor, Mapping[str, float | str]],
    tuple[torch.Tensor, dict[str, float]],
]


@dataclass(frozen=True)
class LossSpec:
    """A named loss: the per-position inputs it needs besides ``target_tokens``."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    impl: LossImpl


def _cross_entropy(logp, inputs, mask, config):
    weights = inputs.get("weights")
    if weights is None:
        weights = mask
    per_token = -logp * weights * mask
    return per_token, {}


def _importance_sampling(logp, inputs, mask, config):
    ratio = torch.exp((logp - inputs["logprobs"]).clamp(max=20.0))
    per_token = -(ratio * inputs["advantages"]) * mask
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        metrics = {"ratio_mean:mean": float((ratio.detach() * mask).sum() / n)}
    return per_token, metrics


def _clip_config(config: Mapping[str, float | str]) -> PolicyLossConfig:
    try:
        low = float(config.get("clip_low_threshold", DEFAULT_CLIP_LOW))
        high = float(config.get("clip_high_threshold", DEFAULT_CLIP_HIGH))
    except (TypeError, ValueError) as exc:
        raise UserError(f"loss_fn_config: clip thresholds must be numbers: {exc}") from exc
    if not 0.0 <= low <= 1.0 <= high:
        raise UserError(
            f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low} and {high}"
        )
    eps_low, eps_high = 1.0 - low, high - 1.0  # the same thresholds for either loss
    return PolicyLossConfig(
        eps_clip_low=eps_low, eps_clip_high=eps_high, cispo_eps_clip_low=eps_low, cispo_eps_clip_high=eps_high
    )


def _policy(name: str) -> LossImpl:
    def impl(logp, inputs, mask, config):
        per_token, metrics = compute_policy_loss(
            name, logp, inputs["logprobs"], inputs["advantages"], mask, _clip_config(config)
        )
        return per_token * mask, {f"{k}:mean": float(v) for k, v in metrics.items()}

    return impl


LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", (), ("weights",), _cross_entropy),
        LossSpec("importance_sampling", ("logprobs", "advantages"), (), _importance_sampling),
        LossSpec("ppo", ("logprobs", "advantages"), (), _policy("regular")),
        LossSpec("cispo", ("logprobs", "advantages"), (), _policy("cispo")),
    )
}


def get_loss(name: str) -> LossSpec:
    """The loss called `name`, or a user error listing the supported ones."""
    spec = LOSSES.get(name)
    if spec is None:
        raise UserError(f"unknown loss_fn {name!r}; this server supports {sorted(LOSSES)}")
    return spec
