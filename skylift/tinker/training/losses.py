"""The Tinker loss functions, evaluated on padded `[batch, tokens]` tensors.

Every loss is a **sum** over tokens and data (no normalisation: the client chooses weights and
advantages), so gradients of chunks sent separately add up to the gradient of the whole batch.
``logp`` is the model's logprob of ``target_tokens``, ``q`` the ``logprobs`` input (the sampler's),
``r = exp(logp - q)`` and ``A`` the ``advantages`` input.

- ``cross_entropy``: ``-sum(logp * weights)``; weights may be any real number, and targets and
  weights may be 2-D (``[N, K]``: K scored tokens per position, as the SDK sends for distillation).
- ``importance_sampling``: ``-sum(r * A)``.
- ``ppo``: ``-sum(min(r * A, clip(r, clip_low_threshold, clip_high_threshold) * A))``.
- ``cispo``: ``-sum(sg(clip(r, low, high)) * A * logp)``.
- ``gspo`` (GSPO-token): the sequence ratio ``s = exp(mean over sequence_ratio_mask of (logp - q))``
  (every position when the mask is absent); each token's ratio is ``sg(s) * exp(logp - sg(logp))``
  and goes through the PPO clip above.
- ``dro``: ``-sum(logp * A - beta / 2 * (logp - q)^2)``, ``beta`` from ``loss_fn_config``
  (default 0.05).
- ``stable_reinforce``: REINFORCE weighted by a clipped, non-differentiated importance ratio
  against the logprobs **the server recorded when it sampled** each token (named by the datum's
  provenance spans, not the client's copy): ``-sum(sg(clip(r_rec, low, high)) * A * logp) +
  kl_coeff * sum(k3(logp, q_rec))`` over sampled positions, with ``low``/``high`` from
  ``clip_low_threshold``/``clip_high_threshold`` (defaults 0 and 2) and ``kl_coeff`` (default 0).
  This is skylift's reading of the SDK's alpha loss: its published description fixes the inputs
  (recorded sampling information, sequence ids, advantages only on sampled tokens), not a formula.

The clip thresholds of ppo, cispo and gspo come from ``loss_fn_config`` (defaults 0.8 and 1.2).
Every loss but cross_entropy also takes the sampling parameters the ``logprobs`` were sampled with
(``temperature``, ``top_k``, ``top_p``, ``min_p``): ``logp`` is then taken under that processed,
truncated distribution (`skylift.tinker.core.loss_sampling`), so ``r`` compares like with like and tokens
outside the sampler's support get no gradient.
PPO, CISPO, GSPO and stable_reinforce use `skylift.algorithms.compute_policy_loss` (``regular``
and ``cispo``), the KL term `skylift.algorithms.compute_kl`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from skylift.algorithms import compute_kl, compute_policy_loss
from skylift.algorithms.supervised import cross_entropy
from skylift.config.algorithm import AlgorithmConfig, CISPOConfig
from skylift.tinker.core.loss_sampling import SAMPLING_KEYS
from skylift.tinker.errors import UserError

DEFAULT_CLIP_LOW = 0.8
DEFAULT_CLIP_HIGH = 1.2
DEFAULT_DRO_BETA = 0.05
STABLE_CLIP_LOW = 0.0
STABLE_CLIP_HIGH = 2.0

#: Inputs the server fills in from provenance for `stable_reinforce` (clients never send them).
RECORDED_LOGPROBS = "skylift_recorded_logprobs"
SAMPLED_MASK = "skylift_sampled_mask"

Config = Mapping[str, float | str]
# (logprobs [B,T] (or [B,T,K]), inputs name -> [B,T], mask [B,T], config) -> (per-token loss, metrics)
LossImpl = Callable[
    [torch.Tensor, Mapping[str, torch.Tensor], torch.Tensor, Config],
    tuple[torch.Tensor, dict[str, float]],
]


@dataclass(frozen=True)
class LossSpec:
    """A named loss: the per-position inputs it needs besides ``target_tokens``."""

    name: str
    required: tuple[str, ...]
    optional: tuple[str, ...]
    impl: LossImpl
    config_keys: tuple[str, ...] = ()
    needs_provenance: bool = False
    two_d_targets: bool = False  # accepts [N, K] target_tokens / weights


def _number(config: Config, key: str, default: float) -> float:
    value = config.get(key, default)
    try:
        return float(value)
    except (TypeError, ValueError) as exc:
        raise UserError(f"loss_fn_config[{key!r}] must be a number, got {value!r}") from exc


def _cross_entropy(logp, inputs, mask, config):
    # [B, T] or [B, T, K] targets: the one supervised loss (skylift.algorithms.supervised)
    return cross_entropy(logp, mask, inputs.get("weights")), {}


def _importance_sampling(logp, inputs, mask, config):
    ratio = torch.exp((logp - inputs["logprobs"]).clamp(max=20.0))
    per_token = -(ratio * inputs["advantages"]) * mask
    with torch.no_grad():
        n = mask.sum().clamp(min=1)
        metrics = {"ratio_mean:mean": float((ratio.detach() * mask).sum() / n)}
    return per_token, metrics


def _clip_config(config: Config, low_default: float, high_default: float) -> AlgorithmConfig:
    """The policy-loss settings of a request: the ``trainer.algorithm`` group with the PPO and the
    CISPO clips both set from the thresholds (every other key at its default)."""
    low = _number(config, "clip_low_threshold", low_default)
    high = _number(config, "clip_high_threshold", high_default)
    if not 0.0 <= low <= 1.0 <= high:
        raise UserError(
            f"loss_fn_config: need 0 <= clip_low_threshold <= 1 <= clip_high_threshold, got {low} and {high}"
        )
    eps_low, eps_high = 1.0 - low, high - 1.0  # the same thresholds for either loss
    return AlgorithmConfig(
        eps_clip_low=eps_low,
        eps_clip_high=eps_high,
        cispo=CISPOConfig(cispo_eps_clip_low=eps_low, cispo_eps_clip_high=eps_high),
    )


def _tagged(metrics: Mapping[str, float], prefix: str = "") -> dict[str, float]:
    return {f"{prefix}{k}:mean": float(v) for k, v in metrics.items()}


def _policy(name: str) -> LossImpl:
    def impl(logp, inputs, mask, config):
        clip = _clip_config(config, DEFAULT_CLIP_LOW, DEFAULT_CLIP_HIGH)
        per_token, metrics = compute_policy_loss(
            name, logp, inputs["logprobs"], inputs["advantages"], mask, clip
        )
        return per_token * mask, _tagged(metrics)

    return impl


def _gspo(logp, inputs, mask, config):
    clip = _clip_config(config, DEFAULT_CLIP_LOW, DEFAULT_CLIP_HIGH)
    ratio_mask = inputs.get("sequence_ratio_mask")
    in_ratio = (ratio_mask != 0).to(mask.dtype) * mask if ratio_mask is not None else mask
    log_ratio = (logp.detach() - inputs["logprobs"]) * in_ratio
    seq = log_ratio.sum(-1, keepdim=True) / in_ratio.sum(-1, keepdim=True).clamp(min=1)
    # PPO's clip on ratio = exp(sg(seq) + logp - sg(logp)): "regular" against old logprobs of 0
    shaped = seq + logp - logp.detach()
    per_token, metrics = compute_policy_loss(
        "regular", shaped, torch.zeros_like(logp), inputs["advantages"], mask, clip
    )
    metrics["sequence_ratio"] = float((seq.exp().squeeze(-1)).mean())
    return per_token * mask, _tagged(metrics)


def _dro(logp, inputs, mask, config):
    beta = _number(config, "beta", DEFAULT_DRO_BETA)
    if beta < 0:
        raise UserError(f"loss_fn_config['beta'] must be >= 0, got {beta}")
    quadratic = (logp - inputs["logprobs"]) ** 2
    return -(logp * inputs["advantages"] - 0.5 * beta * quadratic) * mask, {}


def _stable_reinforce(logp, inputs, mask, config):
    clip = _clip_config(config, STABLE_CLIP_LOW, STABLE_CLIP_HIGH)
    kl_coeff = _number(config, "kl_coeff", 0.0)
    if kl_coeff < 0:
        raise UserError(f"loss_fn_config['kl_coeff'] must be >= 0, got {kl_coeff}")
    sampled = inputs[SAMPLED_MASK] * mask
    recorded = inputs[RECORDED_LOGPROBS]
    per_token, metrics = compute_policy_loss("cispo", logp, recorded, inputs["advantages"], sampled, clip)
    if kl_coeff > 0:
        kl = compute_kl(logp, recorded.detach(), "k3") * sampled
        per_token = per_token + kl_coeff * kl
        metrics["kl"] = float(kl.detach().sum() / sampled.sum().clamp(min=1))
    return per_token * sampled, _tagged(metrics)


_RL = ("logprobs", "advantages")
_CLIP = ("clip_low_threshold", "clip_high_threshold")

LOSSES: dict[str, LossSpec] = {
    spec.name: spec
    for spec in (
        LossSpec("cross_entropy", (), ("weights",), _cross_entropy, two_d_targets=True),
        LossSpec("importance_sampling", _RL, (), _importance_sampling, SAMPLING_KEYS),
        LossSpec("ppo", _RL, (), _policy("regular"), (*_CLIP, *SAMPLING_KEYS)),
        LossSpec("cispo", _RL, (), _policy("cispo"), (*_CLIP, *SAMPLING_KEYS)),
        LossSpec("gspo", _RL, ("sequence_ratio_mask",), _gspo, (*_CLIP, *SAMPLING_KEYS)),
        LossSpec("dro", _RL, (), _dro, ("beta", *SAMPLING_KEYS)),
        LossSpec(
            "stable_reinforce",
            _RL,
            (),
            _stable_reinforce,
            (*_CLIP, "kl_coeff", *SAMPLING_KEYS),
            needs_provenance=True,
        ),
    )
}


def get_loss(name: str) -> LossSpec:
    """The loss called `name`, or a user error listing the supported ones."""
    spec = LOSSES.get(name)
    if spec is None:
        hint = " (custom losses run client-side: use forward_backward_custom)" if name == "custom" else ""
        raise UserError(f"unknown loss_fn {name!r}; this server supports {sorted(LOSSES)}{hint}")
    return spec


def check_config(spec: LossSpec, config: Config) -> None:
    """Refuse `loss_fn_config` keys the loss does not read (they would silently do nothing)."""
    unknown = sorted(set(config) - set(spec.config_keys))
    if unknown:
        raise UserError(
            f"loss_fn_config keys {unknown} do not apply to loss {spec.name!r} "
            f"(it reads {list(spec.config_keys) or 'none'})"
        )
