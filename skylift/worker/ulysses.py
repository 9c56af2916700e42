"""Ulysses sequence parallelism: the collectives and the attention of ranks that split one sequence.

The `sp` ranks of a sequence-parallel group each hold a contiguous slice of the same (packed)
token row. Everything but attention works on a token by itself, so embeddings, MLPs, norms and the
heads run on the local slice. Attention needs the whole sequence: before it, an all-to-all turns
`[b, heads, local tokens, d]` into `[b, heads / sp, all tokens, d]` (each rank gets every token of
its share of the heads); after it, the inverse all-to-all returns `[b, heads, local tokens, d]`
(DeepSpeed-Ulysses, arXiv:2309.14509). Both exchanges are permutations, so each one's backward is
the other.

The attention runs as a transformers attention implementation (`ATTENTION_NAME`, registered on
first use) that `ulysses_attention` switches a model to for one forward pass; the pass's mask (the
whole row's block-causal mask) and group travel in a context, as transformers builds no mask for
an implementation it does not know. Key/value heads are repeated to the query heads before the
exchange (grouped-query attention), and heads are padded with zeros to a multiple of `sp` (a model
with 9 heads runs on 2 ranks; the padded heads' outputs are dropped).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

ATTENTION_NAME = "skylift_ulysses"


@dataclass
class _Pass:
    group: Any  # the sequence-parallel process group
    mask: Tensor  # [1, 1, T, T] bool, True = attend: the whole row's mask


_ACTIVE: list[_Pass] = []


def sequence_parallel_groups(world_size: int, size: int, rank: int) -> Any:
    """This rank's group of `size` consecutive ranks (every rank creates every group, as
    `new_group` needs). Needs the process group; `size` must divide `world_size`."""
    if size < 1 or world_size % size:
        raise ValueError(
            f"sequence_parallel_size={size} must divide the {world_size} ranks of the worker group"
        )
    mine = None
    for start in range(0, world_size, size):
        group = dist.new_group(list(range(start, start + size)))
        if start <= rank < start + size:
            mine = group
    return mine


# ------------------------------------------------------------------------------------ exchanges


def _seq_to_heads(x: Tensor, group: Any) -> Tensor:
    """`[b, H, s, d]` (H a multiple of sp; s local tokens) -> `[b, H / sp, sp * s, d]`."""
    sp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.reshape(b, sp, h // sp, s, d).transpose(0, 1).contiguous()  # chunk j goes to rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's tokens, my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * s, d)


def _heads_to_seq(y: Tensor, group: Any) -> Tensor:
    """`[b, H / sp, sp * s, d]` -> `[b, H, s, d]` (the inverse of `_seq_to_heads`)."""
    sp = dist.get_world_size(group)
    b, h, t, d = y.shape
    send = y.reshape(b, h, sp, t // sp, d).permute(2, 0, 1, 3, 4).contiguous()  # tokens of rank j
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)  # recv[i]: rank i's heads, my tokens
    return recv.transpose(0, 1).reshape(b, sp * h, t // sp, d)


class _AllToAll(torch.autograd.Function):
    """`_seq_to_heads` (`to_heads`) or its inverse `_heads_to_seq`; the gradient goes back through
    the other one."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any, to_heads: bool) -> Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_seq_to_heads if to_heads else _heads_to_seq)(x, group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        inverse = _heads_to_seq if ctx.to_heads else _seq_to_heads
        return inverse(grad.contiguous(), ctx.group), None, None


class _GatherRows(torch.autograd.Function):
    """Every rank's `[k_r, ...]` rows, concatenated in rank order (`sizes` = every k_r, known to
    all ranks). Every rank computes the same loss from the result, so a rank's gradient is the
    slice of its own rows (nothing to add across ranks)."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, sizes: list[int], group: Any) -> Tensor:
        rank = dist.get_rank(group)
        ctx.start, ctx.size = sum(sizes[:rank]), sizes[rank]
        widest = max(sizes)
        padded = local.new_zeros((widest, *local.shape[1:]))
        padded[: local.shape[0]] = local
        parts = [torch.empty_like(padded) for _ in sizes]
        dist.all_gather(parts, padded.contiguous(), group=group)
        return torch.cat([part[:k] for part, k in zip(parts, sizes, strict=True)])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return grad[ctx.start : ctx.start + ctx.size].contiguous(), None, None


def gather_rows(local: Tensor, sizes: list[int], group: Any) -> Tensor:
    """The sequence-parallel group's rows in rank order (see `_GatherRows`); differentiable."""
    return _GatherRows.apply(local, sizes, group)


# ------------------------------------------------------------------------------------ attention


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
    """A transformers attention function: `[b, H, s, d]` local query/key/value -> `[b, s, H, d]`."""
    if not _ACTIVE:
        raise RuntimeError(f"{ATTENTION_NAME} attention runs only inside skylift's ulysses_attention()")
    for name in ("sliding_window", "s_aux"):  # masks and sinks this attention does not apply
        if kwargs.get(name) is not None:
            raise NotImplementedError(f"sequence parallelism does not support attention with {name}")
    active = _ACTIVE[-1]
    sp = dist.get_world_size(active.group)
    heads = query.shape[1]
    if key.shape[1] != heads:  # grouped-query attention: every query head gets its key/value head
        key = key.repeat_interleave(heads // key.shape[1], dim=1)
        value = value.repeat_interleave(heads // value.shape[1], dim=1)
    pad = -heads % sp
    if pad:
        key, value, query = (F.pad(t, (0, 0, 0, 0, 0, pad)) for t in (key, value, query))
    q, k, v = (_AllToAll.apply(t.contiguous(), active.group, True) for t in (query, key, value))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=active.mask, dropout_p=dropout, scale=scaling)
    out = _AllToAll.apply(out.contiguous(), active.group, False)[:, :heads]
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface

    if ATTENTION_NAME not in AttentionInterface._global_mapping:
        AttentionInterface.register(ATTENTION_NAME, _attention)


def _configs(model: torch.nn.Module) -> list[Any]:
    """The transformers configs a model's modules read their attention implementation from."""
    found: dict[int, Any] = {}
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            found[id(config)] = config
    return list(found.values())


@contextlib.contextmanager
def ulysses_attention(model: torch.nn.Module, group: Any, mask: Tensor) -> Iterator[None]:
    """Forward passes of `model` inside run Ulysses attention over `group`, under the whole row's
    `mask` (`[T, T]` bool, True = attend; T = sp x the local tokens)."""
    _register()
    configs = _configs(model)
    saved = [c._attn_implementation for c in configs]
    _ACTIVE.append(_Pass(group=group, mask=mask[None, None]))
    try:
        for config in configs:
            config._attn_implementation = ATTENTION_NAME
        yield
    finally:
        _ACTIVE.pop()
        for config, name in zip(configs, saved, strict=True):
            config._attn_implementation = name


__all__ = ["ATTENTION_NAME", "gather_rows", "sequence_parallel_groups", "ulysses_attention"]
