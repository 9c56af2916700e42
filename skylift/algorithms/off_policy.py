"""Off-policy corrections of a per-token policy loss (``trainer.algorithm.off_policy_correction``).

The rollouts were sampled by an inference engine whose logprobs of the sampled tokens
(``rollout_logprobs``) differ from the trainer's logprobs of the same tokens under the policy being
optimised away from (``old_logprobs``): numerics of another kernel, or a stale policy (async
training). With the per-token importance ratio ``w_t = exp(old_logp_t - rollout_logp_t)`` over the
valid tokens of a sequence, applied in this order (each step sees the mask the previous ones left):

1. outlier token mask (``outlier_token_is_threshold_low``/``_high``, each optional): a sequence
   with any token ``w_t < low`` or ``w_t > high`` is dropped whole;
2. token mask (``token_mask_is_threshold_low`` and ``_high``, set together): tokens with ``w_t``
   outside ``[low, high]`` are dropped;
3. truncated importance sampling, ``tis_ratio_type``: ``"token"`` multiplies each token's loss by
   ``min(w_t, token_tis_ratio_clip_high)``; ``"sequence"`` multiplies every token of a sequence by
   ``min(prod_t w_t, sequence_tis_ratio_clip_high)`` (the product over the tokens still kept);
4. sequence mask, ``sequence_mask_metric``: ``"geometric"`` drops a sequence whose geometric mean
   ``exp(mean_t log w_t)`` is outside ``[geo_mask_low, geo_mask_high]``; ``"product"`` one whose
   product ``prod_t w_t`` is outside ``[product_mask_low, product_mask_high]``.

The settings are read under SkyRL's names from the ``off_policy_correction`` group as it is
(`OffPolicyCorrectionSettings`; the values are checked where the config is validated).

A dropped token's loss becomes 0 and it has no gradient; the loss reduction still counts it (the
mini-batch's token and sequence counts are fixed before the loss is computed). The
weights are constants (no gradient). Log-ratios are clamped to +-20 before ``exp``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from skylift.algorithms.reductions import masked_mean

_CLAMP = 20.0


class OffPolicyCorrectionSettings(Protocol):
    """What the corrections read of ``trainer.algorithm.off_policy_correction`` (SkyRL's names)."""

    tis_ratio_type: str | None
    token_tis_ratio_clip_high: float
    sequence_tis_ratio_clip_high: float
    sequence_mask_metric: str | None
    geo_mask_low: float
    geo_mask_high: float
    product_mask_low: float
    product_mask_high: float
    outlier_token_is_threshold_low: float | None
    outlier_token_is_threshold_high: float | None
    token_mask_is_threshold_low: float | None
    token_mask_is_threshold_high: float | None


def corrections_enabled(c: OffPolicyCorrectionSettings, token_tis_cap: float | None = None) -> bool:
    """Whether any correction of `c` is on (or token TIS with the cap `token_tis_cap`)."""
    return (
        token_tis_cap is not None
        or c.tis_ratio_type is not None
        or c.sequence_mask_metric is not None
        or c.outlier_token_is_threshold_low is not None
        or c.outlier_token_is_threshold_high is not None
        or c.token_mask_is_threshold_low is not None
    )


def _frac(flags: Tensor, mask: Tensor) -> float:
    return float(masked_mean(flags.to(mask.dtype), mask).item())


def _row_frac(flags: Tensor) -> float:
    return float(flags.float().mean().item()) if flags.numel() else 0.0


def apply_off_policy_correction(
    loss: Tensor,
    old_logprobs: Tensor,
    rollout_logprobs: Tensor,
    mask: Tensor,
    c: OffPolicyCorrectionSettings,
    token_tis_cap: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The per-token ``loss`` reweighted and masked by the corrections of `c`, and their metrics
    (fractions over the valid tokens of ``mask``, or over the rows for sequence-level ones).

    ``token_tis_cap``: token TIS with this cap in place of `c`'s TIS (``use_tis`` with
    ``tis_imp_ratio_cap``, the older spelling; the config refuses both at once)."""
    metrics: dict[str, float] = {}
    if not corrections_enabled(c, token_tis_cap):
        return loss, metrics
    tis = "token" if token_tis_cap is not None else c.tis_ratio_type
    token_cap = token_tis_cap if token_tis_cap is not None else c.token_tis_ratio_clip_high
    seq_cap = c.sequence_tis_ratio_clip_high
    low_out, high_out = c.outlier_token_is_threshold_low, c.outlier_token_is_threshold_high
    low_tok, high_tok = c.token_mask_is_threshold_low, c.token_mask_is_threshold_high
    with torch.no_grad():
        log_w = (old_logprobs - rollout_logprobs).clamp(-_CLAMP, _CLAMP)
        w = torch.exp(log_w)
        keep = (mask != 0).to(loss.dtype)
        metrics["is_ratio_mean"] = _frac(w, mask)
        if low_out is not None or high_out is not None:
            low = w < low_out if low_out is not None else torch.zeros_like(w, dtype=torch.bool)
            high = w > high_out if high_out is not None else torch.zeros_like(low)
            valid = keep != 0
            bad_rows = ((low | high) & valid).any(dim=-1)
            keep = keep * (~bad_rows).unsqueeze(-1).to(keep.dtype)
            metrics["outlier_seq_masked_frac"] = _row_frac(bad_rows)
        if low_tok is not None and high_tok is not None:
            outside = ((w < low_tok) | (w > high_tok)) & (keep != 0)
            metrics["token_mask_frac"] = _frac(outside, mask)
            keep = keep * (~outside).to(keep.dtype)
        weight = torch.ones_like(w)
        if tis == "token":
            weight = w.clamp(max=token_cap)
            metrics["tis_weight_mean"] = _frac(weight, mask)
            metrics["tis_clip_frac"] = _frac(w > token_cap, mask)
        seq_log_w = (log_w * keep).sum(dim=-1)  # log of the product over the tokens kept
        if tis == "sequence":
            seq_w = torch.exp(seq_log_w.clamp(-_CLAMP, _CLAMP))
            weight = seq_w.clamp(max=seq_cap).unsqueeze(-1).expand_as(w)
            metrics["tis_seq_weight_mean"] = float(seq_w.clamp(max=seq_cap).mean().item())
            metrics["tis_seq_clip_frac"] = _row_frac(seq_w > seq_cap)
        if c.sequence_mask_metric is not None:
            if c.sequence_mask_metric == "geometric":
                kept = keep.sum(dim=-1).clamp(min=1.0)
                seq_ratio = torch.exp((seq_log_w / kept).clamp(-_CLAMP, _CLAMP))
                low_b, high_b = c.geo_mask_low, c.geo_mask_high
            else:
                seq_ratio = torch.exp(seq_log_w.clamp(-_CLAMP, _CLAMP))
                low_b, high_b = c.product_mask_low, c.product_mask_high
            over, under = seq_ratio > high_b, seq_ratio < low_b
            keep = keep * (~(over | under)).unsqueeze(-1).to(keep.dtype)
            metrics["seq_mask_frac"] = _row_frac(over | under)
            metrics["seq_mask_over_high_frac"] = _row_frac(over)
            metrics["seq_mask_under_low_frac"] = _row_frac(under)
        factor = (weight * keep).to(loss.dtype)
    return loss * factor, metrics
