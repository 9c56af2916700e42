"""Padded tensor batches built from token-id rollouts.

Layout: every row is `prompt (left-padded to P) + response (right-padded to R)`, so the response
of every row starts at column P and per-token response tensors are `[B, R]`. Left padding keeps
the response columns aligned; `position_ids` restart at 0 at each row's first real token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor


@dataclass
class SequenceBatch:
    """Prompt + response token ids of B rows, plus optional per-token response tensors."""

    input_ids: Tensor  # [B, P + R] long
    attention_mask: Tensor  # [B, P + R] long (1 = real token)
    response_mask: Tensor  # [B, R] float (1 = token that counts in the loss)
    prompt_len: int  # P
    extras: dict[str, Tensor] = field(default_factory=dict)  # [B, R, ...] or [B] tensors
    # per-row model inputs concatenated along dim 0 for a forward pass (a vision-language model's
    # `pixel_values` and `image_grid_thw`); None for text
    row_inputs: list[dict[str, Tensor]] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def response_len(self) -> int:
        return int(self.input_ids.shape[1]) - self.prompt_len

    @property
    def response_ids(self) -> Tensor:
        return self.input_ids[:, self.prompt_len :]

    @property
    def position_ids(self) -> Tensor:
        return (self.attention_mask.cumsum(-1) - 1).clamp(min=0)

    def select(self, index: Tensor | Sequence[int]) -> SequenceBatch:
        """Rows `index`, trimmed of columns that are padding in every selected row."""
        idx = torch.as_tensor(index, dtype=torch.long)
        ids = self.input_ids[idx]
        att = self.attention_mask[idx]
        resp_mask = self.response_mask[idx]
        extras = {k: v[idx] for k, v in self.extras.items()}
        real = att.bool()
        prompt_real = real[:, : self.prompt_len].any(0)
        first = int(prompt_real.float().argmax()) if bool(prompt_real.any()) else self.prompt_len
        resp_real = real[:, self.prompt_len :].any(0)
        last = int(resp_real.nonzero().max()) + 1 if bool(resp_real.any()) else 1
        end = self.prompt_len + last
        extras = {k: (v[:, :last] if v.dim() >= 2 else v) for k, v in extras.items()}
        rows = None if self.row_inputs is None else [self.row_inputs[i] for i in idx.tolist()]
        return SequenceBatch(
            input_ids=ids[:, first:end],
            attention_mask=att[:, first:end],
            response_mask=resp_mask[:, :last],
            prompt_len=self.prompt_len - first,
            extras=extras,
            row_inputs=rows,
        )

    def with_extras(self, **tensors: Tensor) -> SequenceBatch:
        return replace(self, extras={**self.extras, **tensors})

    def to(self, device: torch.device | str) -> SequenceBatch:
        return SequenceBatch(
            input_ids=self.input_ids.to(device),
            attention_mask=self.attention_mask.to(device),
            response_mask=self.response_mask.to(device),
            prompt_len=self.prompt_len,
            extras={k: v.to(device) for k, v in self.extras.items()},
            row_inputs=None
            if self.row_inputs is None
            else [{k: v.to(device) for k, v in row.items()} for row in self.row_inputs],
        )


def build_sequence_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    loss_masks: Sequence[Sequence[int]] | None = None,
    pad_token_id: int = 0,
    per_token: dict[str, Sequence[Sequence[float]]] | None = None,
) -> SequenceBatch:
    """Pad token-id lists into a `SequenceBatch`.

    `loss_masks[i]` has one entry per response token (1 = trained on, 0 = e.g. an environment
    observation in a multi-turn rollout); by default every response token counts. `per_token`
    lists (e.g. rollout logprobs) are right-padded with zeros to `[B, R]`.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    if not prompts:
        raise ValueError("cannot build an empty batch")
    batch = len(prompts)
    prompt_len = max(len(p) for p in prompts)
    resp_len = max(1, max(len(r) for r in responses))
    input_ids = torch.full((batch, prompt_len + resp_len), pad_token_id, dtype=torch.long)
    attention = torch.zeros((batch, prompt_len + resp_len), dtype=torch.long)
    response_mask = torch.zeros((batch, resp_len), dtype=torch.float32)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        if not prompt:
            raise ValueError(f"row {i}: empty prompt")
        start = prompt_len - len(prompt)
        input_ids[i, start:prompt_len] = torch.as_tensor(list(prompt), dtype=torch.long)
        attention[i, start:prompt_len] = 1
        n = len(response)
        if n:
            input_ids[i, prompt_len : prompt_len + n] = torch.as_tensor(list(response), dtype=torch.long)
            attention[i, prompt_len : prompt_len + n] = 1
        if loss_masks is None:
            response_mask[i, :n] = 1.0
        else:
            if len(loss_masks[i]) != n:
                raise ValueError(f"row {i}: loss mask has {len(loss_masks[i])} entries for {n} tokens")
            response_mask[i, :n] = torch.as_tensor(list(loss_masks[i]), dtype=torch.float32)
    extras: dict[str, Tensor] = {}
    for name, rows in (per_token or {}).items():
        tensor = torch.zeros((batch, resp_len), dtype=torch.float32)
        for i, row in enumerate(rows):
            if len(row) != len(responses[i]):
                raise ValueError(f"row {i}: {name} has {len(row)} entries for {len(responses[i])} tokens")
            if len(row):
                tensor[i, : len(row)] = torch.as_tensor(list(row), dtype=torch.float32)
        extras[name] = tensor
    return SequenceBatch(input_ids, attention, response_mask, prompt_len, extras)


def split_rows(batch_size: int, chunk: int) -> list[list[int]]:
    """Consecutive row-index chunks of at most `chunk` rows."""
    if chunk <= 0:
        raise ValueError(f"chunk size must be positive, got {chunk}")
    return [list(range(i, min(i + chunk, batch_size))) for i in range(0, batch_size, chunk)]


__all__ = [
    "SequenceBatch",
    "build_sequence_batch",
    "split_rows",
]
