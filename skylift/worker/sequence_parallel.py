"""A training worker's side of sequence parallelism (`sequence_parallel_size`, Ulysses).

The worker group hands each rank its own rows, as without sequence parallelism. The `sp` ranks of
a sequence-parallel group first pool their rows (`pool_rows`: every rank of the group then holds
the same batch, in rank order) and cut the pool into the same micro-batches. Each micro-batch is
packed into one row (skylift.worker.micro_batches.pack: the sequences end to end, positions
restarting at 0), padded to a multiple of `sp` and split into `sp` contiguous slices, one per
rank (`SequenceSplit`). A rank runs the model on its slice with Ulysses attention
(skylift.worker.ulysses) and scores the response tokens its slice predicts; the group gathers the
scores so that every rank has the whole micro-batch's logprobs or values and computes the same
loss. Backpropagating it, a rank gets the gradient of its own tokens; the ranks' gradients add up
to the micro-batch's (FSDP's reduction over all ranks adds them, as it adds the data-parallel
ranks'), and the memory of activations per rank is that of `1 / sp` of the tokens.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from skylift.algorithms.sample_support import Sampling, logprobs_with_full, token_logprobs
from skylift.worker.batch import SequenceBatch
from skylift.worker.micro_batches import pack
from skylift.worker.ulysses import gather_rows, ulysses_attention


def concat_batches(batches: list[SequenceBatch]) -> SequenceBatch:
    """One batch of the rows of `batches` in order: prompts left-padded to the widest prompt,
    responses (and per-token extras) right-padded to the widest response."""
    if any(b.row_inputs is not None for b in batches):
        raise ValueError(
            "sequence parallelism splits text rows only (this batch has image inputs or routed experts)"
        )
    prompt = max(b.prompt_len for b in batches)
    response = max(b.response_len for b in batches)
    names = set(batches[0].extras)
    if any(set(b.extras) != names for b in batches):
        raise ValueError("the batches to pool carry different extras")

    def widen(b: SequenceBatch, t: Tensor) -> Tensor:
        return F.pad(t, (prompt - b.prompt_len, response - b.response_len))

    def extra(b: SequenceBatch, t: Tensor) -> Tensor:
        if t.dim() < 2:
            return t
        pad = [0, 0] * (t.dim() - 2) + [0, response - t.shape[1]]
        return F.pad(t, pad)

    return SequenceBatch(
        input_ids=torch.cat([widen(b, b.input_ids) for b in batches]),
        attention_mask=torch.cat([widen(b, b.attention_mask) for b in batches]),
        response_mask=torch.cat([F.pad(b.response_mask, (0, response - b.response_len)) for b in batches]),
        prompt_len=prompt,
        extras={k: torch.cat([extra(b, b.extras[k]) for b in batches]) for k in sorted(names)},
    )


def pool_rows(batch: SequenceBatch, group: Any) -> tuple[SequenceBatch, slice]:
    """The rows of every rank of `group` pooled in rank order, and where this rank's rows are."""
    parts: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, batch, group=group)
    rank = dist.get_rank(group)
    start = sum(p.batch_size for p in parts[:rank])
    return concat_batches(parts), slice(start, start + batch.batch_size)


class SequenceSplit:
    """One micro-batch's packed row, split over the ranks of a sequence-parallel group."""

    def __init__(self, micro: SequenceBatch, group: Any) -> None:
        if micro.row_inputs is not None or "target_ids" in micro.extras:
            raise ValueError(
                "sequence parallelism scores the response tokens of text rows only "
                "(no image inputs or routed experts, no target_ids)"
            )
        self.micro, self.group = micro, group
        self.layout = pack(micro)
        sp, rank = dist.get_world_size(group), dist.get_rank(group)
        length = self.layout.input_ids.shape[1]
        self.width = -(-length // sp)  # tokens per rank
        total = self.width * sp
        pad = total - length
        self.input_ids = F.pad(self.layout.input_ids, (0, pad))
        self.position_ids = F.pad(self.layout.position_ids, (0, pad))
        # block-causal: a token sees the earlier tokens of its own sequence; padding is its own block
        segment = torch.cumsum((self.layout.position_ids[0] == 0).long(), 0)
        segment = F.pad(segment, (0, pad), value=0)
        causal = torch.ones(total, total, dtype=torch.bool, device=segment.device).tril()
        self.mask = causal & (segment[:, None] == segment[None, :])
        self.start = rank * self.width
        keep = self.layout.keep
        owner = torch.div(keep, self.width, rounding_mode="floor")
        self.sizes = [int((owner == r).sum()) for r in range(sp)]
        mine = owner == rank
        self.local_keep = keep[mine] - self.start  # positions in this rank's slice
        self.local_targets = self.layout.targets[mine]

    def attention(self, model: torch.nn.Module) -> contextlib.AbstractContextManager[None]:
        """Ulysses attention under this micro-batch's mask: forward and backward (activation
        checkpointing recomputes the forward during backward) must both run inside."""
        return ulysses_attention(model, self.group, self.mask)

    def _local_inputs(self) -> dict[str, Tensor]:
        end = self.start + self.width
        return {
            "input_ids": self.input_ids[:, self.start : end],
            "position_ids": self.position_ids[:, self.start : end],
        }

    def _scatter(self, flat: Tensor) -> Tensor:
        micro, layout = self.micro, self.layout
        out = torch.zeros(
            (micro.batch_size, micro.response_len, *flat.shape[1:]), dtype=flat.dtype, device=flat.device
        )
        return out.index_put((layout.rows, layout.cols), flat)

    def logprobs(
        self, model: torch.nn.Module, temperature: Sampling = 1.0, with_full: bool = False
    ) -> Tensor:
        """`[b, R]` (`[b, R, 2]` `with_full`) logprobs of the response tokens, zeros at padding, on
        every rank of the group (as `skylift.worker.micro_batches.packed_response_logprobs`)."""
        out = model(
            **self._local_inputs(), attention_mask=None, use_cache=False, logits_to_keep=self.local_keep
        )
        score = logprobs_with_full if with_full else token_logprobs
        local = score(out.logits[0], self.local_targets, temperature)
        return self._scatter(gather_rows(local, self.sizes, self.group))

    def values(self, model: torch.nn.Module) -> Tensor:
        """`[b, R]` value estimates (head "value"), zeros at padding, on every rank of the group."""
        out = model(**self._local_inputs(), attention_mask=None, use_cache=False)
        local = out.logits[0, self.local_keep, 0].float()
        return self._scatter(gather_rows(local, self.sizes, self.group))


__all__ = ["SequenceSplit", "concat_batches", "pool_rows"]
