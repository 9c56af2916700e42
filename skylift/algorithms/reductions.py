"""Loss reductions: how a `[batch, response_len]` per-token loss becomes the scalar to backpropagate.

Modes (`mask` is the float loss mask, 1 for tokens that count):

- ``token_mean``: ``sum(loss * mask) / N_tok`` where ``N_tok`` is the number of valid tokens in the
  whole mini-batch. Every token weighs the same.
- ``sequence_mean``: ``(1 / N_seq) * sum_i [ sum_t(loss_it * mask_it) / sum_t(mask_it) ]``: the mean
  over sequences of each sequence's token mean. Every sequence weighs the same.
- ``seq_mean_token_sum_norm`` (Dr. GRPO): ``(1 / N_seq) * sum_i [ sum_t(loss_it * mask_it) / L ]``
  where ``L`` is a constant (the maximum response length, e.g. ``generator.max_generate_length``),
  so a token's weight depends neither on its sequence's length nor on the padding of the batch.

``N_seq`` counts the sequences with at least one valid token: a fully masked row (a filtered or empty
response) contributes nothing and does not dilute the others.

Micro-batching (gradient accumulation) gives exactly the mini-batch gradient
-------------------------------------------------------------------------------
All three modes are *sums over sequences* of a per-sequence term divided by a mini-batch constant
(``N_tok``, ``N_seq`` or ``N_seq * L``). The per-sequence term only depends on that sequence, so if
every micro-batch divides by the **mini-batch** constants instead of its own, the micro-batch losses
are partial sums that add up to the mini-batch loss, and so do their gradients::

    totals = mini_batch_totals(mini_batch_mask)          # once per mini-batch, before splitting
    for micro in split(mini_batch):
        per_token = policy_loss(...)                      # [micro_batch, len_of_this_micro_batch]
        loss = reduce_loss(per_token, micro.mask, mode,
                           global_token_count=totals.token_count,
                           global_seq_count=totals.seq_count,
                           max_len=max_generate_length)
        loss.backward()                                   # gradients accumulate: no extra scaling
    optimizer.step()

Micro-batches may be padded to different lengths: padding is masked and ``L`` is a constant that is
passed, not read from the tensor shape. Without the ``global_*`` arguments ``reduce_loss`` uses the
counts of the tensor it is given, which is right when that tensor is the whole mini-batch.

With data parallelism the mini-batch is spread over ``world_size`` ranks. Pass totals summed over
all ranks (an all-reduce of ``mini_batch_totals``); since FSDP/DDP *average* gradients across ranks,
multiply each rank's loss by ``world_size`` (or all-reduce gradients with a sum instead).
"""

from __future__ import annotations

from typing import Literal, NamedTuple, get_args

import torch

LossReduction = Literal["token_mean", "sequence_mean", "seq_mean_token_sum_norm"]
LOSS_REDUCTIONS: tuple[str, ...] = get_args(LossReduction)


class MiniBatchTotals(NamedTuple):
    """Counts of a whole mini-batch that every micro-batch's loss is normalised by."""

    token_count: int
    """Valid tokens (sum of the loss mask)."""
    seq_count: int
    """Sequences with at least one valid token."""


def mini_batch_totals(loss_mask: torch.Tensor) -> MiniBatchTotals:
    """Token and sequence counts of a `[batch, len]` loss mask (call it on the whole mini-batch)."""
    _check_2d("loss_mask", loss_mask)
    mask = loss_mask.detach().to(torch.float64)
    return MiniBatchTotals(
        token_count=int(round(mask.sum().item())),
        seq_count=int((mask.sum(dim=-1) > 0).sum().item()),
    )


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is non-zero (masked positions cannot leak NaN or inf)."""
    mask = mask.to(values.dtype)
    masked = torch.where(mask != 0, values * mask, torch.zeros_like(values))
    return masked.sum() if dim is None else masked.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over positions where `mask` is non-zero; 0 where there are none."""
    count = mask.to(values.dtype).sum() if dim is None else mask.to(values.dtype).sum(dim=dim)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def reduce_loss(
    per_token_loss: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    *,
    global_token_count: float | None = None,
    global_seq_count: float | None = None,
    max_len: int | None = None,
) -> torch.Tensor:
    """Reduce a `[batch, len]` per-token loss to a scalar according to `mode` (see module docstring).

    `global_token_count` / `global_seq_count` are the mini-batch totals (`mini_batch_totals`) when
    `per_token_loss` is one micro-batch of it; leave them out for a whole mini-batch. `max_len` is the
    constant `L` of `seq_mean_token_sum_norm`; it defaults to the tensor's length only for a whole
    mini-batch, and is required with micro-batches (their padded lengths differ).
    """
    _check_2d("per_token_loss", per_token_loss)
    if loss_mask.shape != per_token_loss.shape:
        raise ValueError(
            f"loss_mask shape {tuple(loss_mask.shape)} != per_token_loss shape {tuple(per_token_loss.shape)}"
        )
    if mode not in LOSS_REDUCTIONS:
        raise ValueError(f"unknown loss reduction {mode!r}; known: {', '.join(LOSS_REDUCTIONS)}")
    mask = loss_mask.to(per_token_loss.dtype)

    if mode == "token_mean":
        token_count = (
            mask.sum() if global_token_count is None else _positive("global_token_count", global_token_count)
        )
        return masked_sum(per_token_loss, mask) / _clamp_count(token_count)

    seq_count = (
        (mask.sum(dim=-1) > 0).sum().to(per_token_loss.dtype)
        if global_seq_count is None
        else _positive("global_seq_count", global_seq_count)
    )
    seq_sums = masked_sum(per_token_loss, mask, dim=-1)
    if mode == "sequence_mean":
        seq_terms = seq_sums / mask.sum(dim=-1).clamp(min=1)
    else:  # seq_mean_token_sum_norm
        if max_len is None:
            if global_token_count is not None or global_seq_count is not None:
                raise ValueError(
                    "seq_mean_token_sum_norm on a micro-batch needs max_len (a constant such as the "
                    "maximum generation length); the tensor's own length differs between micro-batches"
                )
            max_len = per_token_loss.shape[-1]
        if max_len <= 0:
            raise ValueError(f"max_len must be positive, got {max_len}")
        seq_terms = seq_sums / max_len
    return seq_terms.sum() / _clamp_count(seq_count)


def _clamp_count(count: torch.Tensor | float) -> torch.Tensor | float:
    """A count of 0 means an all-masked batch whose numerator is 0 too: divide by 1 instead of 0."""
    if isinstance(count, torch.Tensor):
        return count.clamp(min=1)
    return max(count, 1)


def _positive(name: str, value: float) -> float:
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    return float(value)


def _check_2d(name: str, tensor: torch.Tensor) -> None:
    if tensor.dim() != 2:
        raise ValueError(f"{name} must be [batch, response_len], got shape {tuple(tensor.shape)}")
