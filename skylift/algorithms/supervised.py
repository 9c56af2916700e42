"""The supervised loss: weighted negative log-likelihood of target tokens.

One implementation serves every place that trains on targets: `skylift sft` (the supervised
stages, `skylift.supervised`), the Tinker service's ``cross_entropy`` loss and the RL trainer's
``policy_loss_type=cross_entropy``. The result is per token (no reduction): callers sum it and
divide by what they normalise by (the step's loss tokens for SFT, nothing for Tinker).
"""

from __future__ import annotations

import torch
from torch import Tensor


def cross_entropy(logprobs: Tensor, mask: Tensor, weights: Tensor | None = None) -> Tensor:
    """``-logprobs * weights`` where `mask` is set, per token.

    `logprobs` is `[B, T]`, or `[B, T, K]` (K scored tokens per position, as Tinker's SDK sends for
    distillation; then the K terms are summed per position). `weights` defaults to the mask itself
    (every target counts once) and may be any real number.
    """
    if logprobs.dim() == 3:
        w = weights if weights is not None else torch.ones_like(logprobs)
        return -(logprobs * w).sum(-1) * mask
    w = weights if weights is not None else mask
    return -logprobs * w * mask


__all__ = ["cross_entropy"]
