"""How a worker cuts a batch into micro-batches, and the padding-free (packed) forward pass.

Rows are ordered so that rows sharing a prompt stay together (one prompt forward serves them all)
and long groups come first (less padding). A micro-batch is then either at most `max_rows` rows,
or, with a token budget, as many rows as fit in `max_tokens`: counted as padded cells
(rows x width) for a padded micro-batch, as real tokens for a packed one. A row longer than the
budget on its own still gets a micro-batch of its own (a sequence is never split).

A packed micro-batch is one row: every sequence's real tokens end to end, `position_ids`
restarting at 0 at each sequence and no attention mask, from which transformers builds the
block-diagonal causal mask (eager; varlen kernels with flash attention; under SDPA the row's
sequences attend one at a time instead, `skylift.worker.packed_attention`). Only the positions
that predict response tokens get logits (`logits_to_keep` as an index tensor).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from skylift.algorithms.sample_support import Sampling, logprobs_with_full, token_logprobs
from skylift.worker.batch import SequenceBatch, split_rows
from skylift.worker.logprobs import unique_prompts
from skylift.worker.packed_attention import sequence_attention
from skylift.worker.vision_inputs import with_sampling_bias


def ordered_rows(batch: SequenceBatch) -> list[int]:
    """Row indices: rows sharing a prompt adjacent, groups by decreasing length."""
    _, inverse = unique_prompts(batch)
    lengths = batch.attention_mask.sum(-1)
    groups: dict[int, list[int]] = {}
    for row, group in enumerate(inverse.tolist()):
        groups.setdefault(group, []).append(row)
    ordered = sorted(groups.values(), key=lambda rows: -int(lengths[rows].max()))
    return [row for rows in ordered for row in sorted(rows, key=lambda r: -int(lengths[r]))]


def micro_batch_rows(
    batch: SequenceBatch, max_rows: int, max_tokens: int | None = None, packed: bool = False
) -> list[list[int]]:
    """Row indices of each micro-batch (see the module docstring)."""
    order = ordered_rows(batch)
    if max_tokens is None or max_tokens <= 0:
        return [[order[i] for i in chunk] for chunk in split_rows(len(order), max_rows)]
    real = batch.attention_mask.bool()
    prompt_lens = real[:, : batch.prompt_len].sum(-1).tolist()
    response_lens = real[:, batch.prompt_len :].sum(-1).tolist()
    chunks: list[list[int]] = []
    current: list[int] = []
    tokens = widest_prompt = widest_response = 0
    for row in order:
        p, r = int(prompt_lens[row]), int(response_lens[row])
        if packed:
            cost = tokens + p + r
        else:  # the padded micro-batch is as wide as its longest prompt plus its longest response
            cost = (len(current) + 1) * (max(widest_prompt, p) + max(widest_response, r))
        if current and cost > max_tokens:
            chunks.append(current)
            current, tokens, widest_prompt, widest_response = [], 0, 0, 0
        current.append(row)
        tokens += p + r
        widest_prompt, widest_response = max(widest_prompt, p), max(widest_response, r)
    if current:
        chunks.append(current)
    return chunks


@dataclass(frozen=True)
class PackedLayout:
    """Where a micro-batch's sequences sit in its packed row."""

    input_ids: Tensor  # [1, T]
    position_ids: Tensor  # [1, T], restarting at 0 per sequence
    keep: Tensor  # [K] positions whose logits predict a response token, in row-major order
    rows: Tensor  # [K] the response token's row in the micro-batch
    cols: Tensor  # [K] its response column
    targets: Tensor  # [K] the response token
    lengths: list[int]  # each sequence's length in the row, in row order


def pack(micro: SequenceBatch, targets_only: bool = False) -> PackedLayout:
    """The packed row of `micro`. A row's real tokens are contiguous (prompt left-padded to P,
    response right-padded), so masking keeps each sequence whole and in row order. `targets_only`:
    keep only the positions of the response tokens `response_mask` marks (the others score 0)."""
    real = micro.attention_mask.bool()
    lengths = real.sum(-1)
    offsets = torch.cumsum(lengths, 0) - lengths
    prompt_lens = real[:, : micro.prompt_len].sum(-1)
    response_real = real[:, micro.prompt_len :]
    if targets_only:
        response_real = response_real & micro.response_mask.bool()
    rows, cols = response_real.nonzero(as_tuple=True)
    # the logits at (offset + prompt length - 1 + t) predict response token t
    keep = offsets[rows] + prompt_lens[rows] - 1 + cols
    return PackedLayout(
        input_ids=micro.input_ids[real].unsqueeze(0),
        position_ids=micro.position_ids[real].unsqueeze(0),
        keep=keep,
        rows=rows,
        cols=cols,
        targets=micro.response_ids[rows, cols],
        lengths=[int(n) for n in lengths.tolist()],
    )


def _scatter(micro: SequenceBatch, layout: PackedLayout, flat: Tensor) -> Tensor:
    shape = (micro.batch_size, micro.response_len, *flat.shape[1:])
    out = torch.zeros(shape, dtype=flat.dtype, device=flat.device)
    return out.index_put((layout.rows, layout.cols), flat)


def packed_response_logprobs(
    model: torch.nn.Module,
    micro: SequenceBatch,
    temperature: Sampling = 1.0,
    with_full: bool = False,
    targets_only: bool = False,
) -> Tensor:
    """Logprobs `[b, R]` of `micro.response_ids` (zeros at padding), from one packed forward
    (`temperature` and `with_full` as in `skylift.worker.logprobs.response_logprobs`).
    `targets_only`: the unembedding and softmax run only where `response_mask` is set (zeros
    elsewhere), for callers that use nothing else (the supervised losses)."""
    layout = pack(micro, targets_only)
    with sequence_attention(model, layout.lengths):
        out = model(
            input_ids=layout.input_ids,
            position_ids=layout.position_ids,
            attention_mask=None,
            use_cache=False,
            logits_to_keep=layout.keep,
        )
    score = logprobs_with_full if with_full else token_logprobs
    logits = with_sampling_bias(model, out.logits[0])  # a vision-language policy's banned tokens
    return _scatter(micro, layout, score(logits, layout.targets, temperature))


def packed_response_values(model: torch.nn.Module, micro: SequenceBatch) -> Tensor:
    """A value model's estimate per response token `[b, R]` (zeros at padding), read at the
    positions `packed_response_logprobs` scores, from one packed forward."""
    layout = pack(micro)
    with sequence_attention(model, layout.lengths):
        out = model(
            input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=None, use_cache=False
        )
    return _scatter(micro, layout, out.logits[0, layout.keep, 0].float())


__all__ = [
    "PackedLayout",
    "micro_batch_rows",
    "ordered_rows",
    "pack",
    "packed_response_logprobs",
    "packed_response_values",
]
