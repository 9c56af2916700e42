"""Off-policy corrections of a per-token policy loss (``trainer.algorithm.off_policy_correction``).

The rollouts were sampled by an inference engine whose logprobs of the sampled tokens
(``rollout_logprobs``) differ from the trainer's logprobs of the same tokens under the policy being
optimised away from (``old_logprobs``): numerics of another kernel, or a stale policy (async
training). With the per-token importance ratio ``w_t = exp(old_logp_t - rollout_logp_t)`` over the
valid tokens of a sequence, applied in this order (each step sees the mask the previous ones left):

1. outlier token mask (``outlier_token_low``/``outlier_token_high``, each optional): a sequence
   with any token ``w_t < low`` or ``w_t > high`` is dropped whole;
2. token mask (``token_mask_low`` and ``token_mask_high``, set together): tokens with ``w_t`` outside
   ``[low, high]`` are dropped;
3. truncated importance sampling, ``tis``: ``"token"`` multiplies each token's loss by
   ``min(w_t, token_tis_cap)``; ``"sequence"`` multiplies every token of a sequence by
   ``min(prod_t w_t, sequence_tis_cap)`` (the product over the tokens still kept);
4. sequence mask, ``sequence_mask``: ``"geometric"`` drops a sequence whose geometric mean
   ``exp(mean_t log w_t)`` is outside ``[geo_mask_low, geo_mask_high]``; ``"product"`` one whose
   product ``prod_t w_t`` is outside ``[product_mask_low, product_mask_high]``.

A dropped token's loss becomes 0 and it has no gradient; the loss reduction still counts it (the
mini-batch's token and sequence counts are fixed before the loss is computed). The
weights are constants (no gradient). Log-ratios are clamped to +-20 before ``exp``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from skylift.algorithms.reductions import masked_mean

TIS_TYPES = ("token", "sequence")
SEQUENCE_MASKS = ("geometric", "product")
_CLAMP = 20.0


@dataclass(frozen=True)
class OffPolicyCorrection:
    """Which corrections apply and their bounds (see the module docstring); all off by default."""

    tis: str | None = None
    token_tis_cap: float = 2.0
    sequence_tis_cap: float = 5.0
    sequence_mask: str | None = None
    geo_mask_low: float = 0.99
    geo_mask_high: float = 1.01
    product_mask_low: float = 0.5
    product_mask_high: float = 2.0
    outlier_token_low: float | None = None
    outlier_token_high: float | None = None
    token_mask_low: float | None = None
    token_mask_high: float | None = None

    def __post_init__(self) -> None:
        if self.tis not in (None, *TIS_TYPES):
            raise ValueError(f"tis must be None or one of {TIS_TYPES}, got {self.tis!r}")
        if self.sequence_mask not in (None, *SEQUENCE_MASKS):
            raise ValueError(
                f"sequence_mask must be None or one of {SEQUENCE_MASKS}, got {self.sequence_mask!r}"
            )
        if self.token_tis_cap <= 0 or self.sequence_tis_cap <= 0:
            raise ValueError(
                f"TIS caps must be > 0, got token {self.token_tis_cap} and sequence {self.sequence_tis_cap}"
            )
        if (self.token_mask_low is None) != (self.token_mask_high is None):
            raise ValueError("token_mask_low and token_mask_high must be set together")
        for name, low, high in (
            ("geo_mask", self.geo_mask_low, self.geo_mask_high),
            ("product_mask", self.product_mask_low, self.product_mask_high),
            ("token_mask", self.token_mask_low, self.token_mask_high),
            ("outlier_token", self.outlier_token_low, self.outlier_token_high),
        ):
            if low is not None and high is not None and low > high:
                raise ValueError(f"{name}_low={low} must be <= {name}_high={high}")

    @property
    def enabled(self) -> bool:
        return (
            self.tis is not None
            or self.sequence_mask is not None
            or self.outlier_token_low is not None
            or self.outlier_token_high is not None
            or self.token_mask_low is not None
        )


def _frac(flags: Tensor, mask: Tensor) -> float:
    return float(masked_mean(flags.to(mask.dtype), mask).item())


def _row_frac(flags: Tensor) -> float:
    return float(flags.float().mean().item()) if flags.numel() else 0.0


def apply_off_policy_correction(
    loss: Tensor, old_logprobs: Tensor, rollout_logprobs: Tensor, mask: Tensor, c: OffPolicyCorrection
) -> tuple[Tensor, dict[str, float]]:
    """The per-token ``loss`` reweighted and masked by the corrections of `c`, and their metrics
    (fractions over the valid tokens of ``mask``, or over the rows for sequence-level ones)."""
    metrics: dict[str, float] = {}
    if not c.enabled:
        return loss, metrics
    with torch.no_grad():
        log_w = (old_logprobs - rollout_logprobs).clamp(-_CLAMP, _CLAMP)
        w = torch.exp(log_w)
        keep = (mask != 0).to(loss.dtype)
        metrics["is_ratio_mean"] = _frac(w, mask)
        if c.outlier_token_low is not None or c.outlier_token_high is not None:
            low = (
                w < c.outlier_token_low
                if c.outlier_token_low is not None
                else torch.zeros_like(w, dtype=torch.bool)
            )
            high = w > c.outlier_token_high if c.outlier_token_high is not None else torch.zeros_like(low)
            valid = keep != 0
            bad_rows = ((low | high) & valid).any(dim=-1)
            keep = keep * (~bad_rows).unsqueeze(-1).to(keep.dtype)
            metrics["outlier_seq_masked_frac"] = _row_frac(bad_rows)
        if c.token_mask_low is not None and c.token_mask_high is not None:
            outside = ((w < c.token_mask_low) | (w > c.token_mask_high)) & (keep != 0)
            metrics["token_mask_frac"] = _frac(outside, mask)
            keep = keep * (~outside).to(keep.dtype)
        weight = torch.ones_like(w)
        if c.tis == "token":
            weight = w.clamp(max=c.token_tis_cap)
            metrics["tis_weight_mean"] = _frac(weight, mask)
            metrics["tis_clip_frac"] = _frac(w > c.token_tis_cap, mask)
        seq_log_w = (log_w * keep).sum(dim=-1)  # log of the product over the tokens kept
        if c.tis == "sequence":
            seq_w = torch.exp(seq_log_w.clamp(-_CLAMP, _CLAMP))
            weight = seq_w.clamp(max=c.sequence_tis_cap).unsqueeze(-1).expand_as(w)
            metrics["tis_seq_weight_mean"] = float(seq_w.clamp(max=c.sequence_tis_cap).mean().item())
            metrics["tis_seq_clip_frac"] = _row_frac(seq_w > c.sequence_tis_cap)
        if c.sequence_mask is not None:
            if c.sequence_mask == "geometric":
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
