"""Attention of a packed row one sequence at a time (what flash attention's varlen kernels do).

A packed micro-batch (`skylift.worker.micro_batches`) holds several sequences end to end in one
row. Under transformers' SDPA attention the row gets a `[T, T]` block-diagonal causal mask, and
PyTorch's kernels compute every one of its T^2 scores (a mask stops no block from being computed),
so attention over a row of n sequences of length L costs (nL)^2 where the sequences need n L^2 / 2.
`sequence_attention` runs a model's forward passes with SDPA on each sequence's slice of the row
under ``is_causal`` instead (no mask built, the causal kernel skips the blocks above the diagonal);
the result is the block-diagonal attention's, in one pass over the heads of every sequence.

It applies to models whose attention implementation is "sdpa" (transformers' default); any other
implementation (eager, flash attention, sequence parallelism's) is left as it is, and so is a row
of one sequence or of fewer than `MIN_ROW_TOKENS` tokens. A sliding-window
layer (Mistral) gets the window's mask on each sequence longer than the window. The pass's
sequence lengths travel in a context, as in `skylift.worker.ulysses`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ATTENTION_NAME = "skylift_packed_sdpa"
#: a shorter row keeps the one masked SDPA call (transformers' own): its T^2 scores cost little
#: there (SmolLM2-135M at 256 tokens: 8% of a layer's multiply-adds), and one call per sequence
#: costs more calls
MIN_ROW_TOKENS = 256
_ACTIVE: list[list[int]] = []  # the lengths of the current pass's sequences, in row order


def _attention(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """A transformers attention function: `[1, H, T, d]` query/key/value of a packed row ->
    `[1, T, H, d]`, each sequence attending causally to itself only."""
    if not _ACTIVE:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside sequence_attention()")
    if kwargs.get("s_aux") is not None:  # attention sinks (which SDPA has no way to apply either)
        raise NotImplementedError("packed attention does not support attention sinks")
    window = kwargs.get("sliding_window")
    if attention_mask is not None or query.shape[0] != 1:
        raise RuntimeError(f"{ATTENTION_NAME} attention takes one packed row and no mask")
    heads = query.shape[1]
    gqa = key.shape[1] != heads
    parts = []
    start = 0
    for length in _ACTIVE[-1]:
        end = start + length
        mask = _sliding_mask(length, window, query.device) if window and length > window else None
        parts.append(
            F.scaled_dot_product_attention(
                query[:, :, start:end],
                key[:, :, start:end],
                value[:, :, start:end],
                attn_mask=mask,
                dropout_p=dropout,
                scale=scaling,
                is_causal=mask is None and length > 1,
                enable_gqa=gqa,
            )
        )
        start = end
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)
    return out.transpose(1, 2).contiguous(), None


def _sliding_mask(length: int, window: int, device: torch.device) -> Tensor:
    """`[length, length]` bool, True = attend: causal, and at most `window - 1` tokens back (the
    sliding-window mask transformers builds)."""
    pos = torch.arange(length, device=device)
    back = pos[:, None] - pos[None, :]
    return (back >= 0) & (back < window)


def _register() -> None:
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, _attention)


def _sdpa_configs(model: torch.nn.Module) -> list[Any] | None:
    """The transformers configs a model's modules read their attention implementation from, if all
    of them use SDPA; None otherwise (the model's attention is then left alone)."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            found[id(config)] = config
    configs = list(found.values())
    if not configs or any(c._attn_implementation != "sdpa" for c in configs):
        return None
    return configs


@contextlib.contextmanager
def sequence_attention(model: torch.nn.Module, lengths: list[int]) -> Iterator[None]:
    """Forward passes of `model` inside attend within each of the packed row's sequences (their
    `lengths`, in row order) and never across them (see the module docstring). The backward pass
    needs no context: the attention's autograd graph is recorded in the forward."""
    configs = _sdpa_configs(model) if sum(lengths) >= MIN_ROW_TOKENS and len(lengths) > 1 else None
    if configs is None:
        yield
        return
    _register()
    _ACTIVE.append(list(lengths))
    try:
        for config in configs:
            config._attn_implementation = ATTENTION_NAME
        yield
    finally:
        _ACTIVE.pop()
        for config in configs:
            config._attn_implementation = "sdpa"


__all__ = ["ATTENTION_NAME", "sequence_attention"]
