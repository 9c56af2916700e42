"""The critic's loss for PPO with `gae`: clipped squared error against the GAE returns.

    v_clipped = old_v + clamp(v - old_v, -clip, clip)
    loss_t    = 0.5 * max((v_t - R_t)^2, (v_clipped_t - R_t)^2)

`old_v` are the values the advantages were computed with (the critic before this update), so the
first update of a batch is the plain squared error; `clip <= 0` disables clipping.
"""

from __future__ import annotations

import torch

from skylift.algorithms.reductions import masked_mean


def compute_value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    mask: torch.Tensor,
    clip: float = 0.2,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Per-token critic loss `[batch, len]` (zero where `mask` is 0) and metrics."""
    shapes = {"values": values.shape, "old_values": old_values.shape, "returns": returns.shape}
    if len({tuple(s) for s in shapes.values()} | {tuple(mask.shape)}) != 1:
        raise ValueError(f"value loss inputs must share one shape, got {shapes} and mask {tuple(mask.shape)}")
    old_values, returns = old_values.detach(), returns.detach()
    squared = (values - returns) ** 2
    if clip > 0:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        squared_clipped = (clipped - returns) ** 2
        per_token = 0.5 * torch.maximum(squared, squared_clipped)
        clip_frac = masked_mean((squared_clipped > squared).float(), mask)
    else:
        per_token = 0.5 * squared
        clip_frac = torch.zeros(())
    per_token = per_token * mask
    with torch.no_grad():
        metrics = {
            "value_loss": float(masked_mean(per_token, mask)),
            "value_clip_frac": float(clip_frac),
            "values_mean": float(masked_mean(values.detach(), mask)),
        }
    return per_token, metrics
