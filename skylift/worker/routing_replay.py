"""Routing replay: a forward of a mixture-of-experts model whose routers pick given experts.

An engine and a trainer compute a router's logits in another order (other kernels, batch shapes,
dtypes); where two experts' scores are close the top-k picks differ, and the trainer scores a token
through experts the engine never used for it. Replaying the engine's choice (R3) makes the
trainer's forward use, in every MoE layer, the experts the engine routed each token to, while the
routing weights stay differentiable functions of the trainer's own router logits.

transformers 5 routers (`Qwen3MoeTopKRouter`, `MixtralTopKRouter`, `OlmoeTopKRouter`,
`Qwen2MoeTopKRouter`, ...) all take `torch.topk` of their softmaxed logits over the experts. While
a router runs under `replay_routing`, that one call (in the thread running the router) answers
with the given experts and their probabilities (gathered from the same tensor), so whatever the
family does next (renormalising the top-k weights or not) is unchanged. A token whose given experts are -1 (the engine did not route it:
the padding of a batch, a rollout's last sampled token, observations after its last turn) keeps the
trainer's own top-k in that layer.

In the trainer (`generator.enable_return_routed_experts`) each row of a `SequenceBatch` carries its
tokens' routing in `row_inputs` (key `ROUTED_EXPERTS`: [the row's real tokens, layers, top_k], in
the order of its prompt then response ids), like a vision-language model's per-row image tensors;
`batch_routing` lays the rows' routing out on the batch's padded positions and `replayed` wraps a
forward (and the backward that may recompute it: gradient checkpointing) of such a batch.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from skylift.worker.batch import SequenceBatch

#: `SequenceBatch.row_inputs` key of a row's routed experts (never passed to the model)
ROUTED_EXPERTS = "routed_experts"

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


class RoutingReplayError(ValueError):
    """The routing to replay does not fit the model or the batch (one line saying how)."""


def moe_routers(model: torch.nn.Module) -> dict[int, torch.nn.Module]:
    """Decoder layer index -> the top-k router of that layer's mixture of experts (layers without
    experts are absent)."""
    routers: dict[int, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if not type(module).__name__.endswith("Router") or not hasattr(module, "top_k"):
            continue
        match = _LAYER.search(name + ".")
        if match:
            routers[int(match.group(1))] = module
    return routers


@dataclass
class RoutingTally:
    """Of the (token, MoE layer) pairs forwards replayed the engine's routing for, how many the
    trainer's own router would have sent to another set of experts (device counters; read once)."""

    routed: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))
    differ: Tensor = field(default_factory=lambda: torch.zeros((), dtype=torch.long))

    def add(self, own: Tensor, given: Tensor, replayed: Tensor) -> None:
        changed = (own.sort(-1).values != given.sort(-1).values).any(-1) & replayed
        self.routed = self.routed.to(own.device) + replayed.sum()
        self.differ = self.differ.to(own.device) + changed.sum()

    def metrics(self) -> dict[str, float]:
        """``routing_differs``: the share of replayed pairs the trainer would have routed
        otherwise (what replay changed); empty when nothing was replayed."""
        routed = int(self.routed)
        return {"routing_differs": int(self.differ) / routed} if routed else {}


@contextlib.contextmanager
def replay_routing(
    model: torch.nn.Module, routed: Tensor, tally: RoutingTally | None = None
) -> Iterator[None]:
    """Within the block, each MoE router of `model` picks the experts of `routed`.

    `routed`: integer [tokens, layers, top_k] (vLLM's `routed_experts` layout), one row per token
    in the order the routers see them (the forward's input ids flattened, row-major), one column
    per decoder layer (a dense layer's column is ignored). A token whose experts in a layer hold a
    -1 keeps the router's own pick there. `tally`: counts, over the block's router calls, the
    replayed pairs whose own pick differs (a backward's recomputed forward counts again)."""
    routers = moe_routers(model)
    if not routers:
        raise RoutingReplayError(f"routing replay: {type(model).__name__} has no mixture-of-experts router")
    if routed.dim() != 3 or routed.shape[1] <= max(routers):
        raise RoutingReplayError(
            f"routing replay: routed experts of shape {tuple(routed.shape)} do not cover the "
            f"{max(routers) + 1} layers of {type(model).__name__} (want [tokens, layers, top_k])"
        )
    handles = []

    def arm(layer: int) -> Any:
        def pre_hook(module: torch.nn.Module, args: Any) -> None:
            _replay.topk = _replayed_topk(_TOPK, routed[:, layer].long(), int(module.top_k), tally)

        return pre_hook

    def disarm(module: torch.nn.Module, args: Any, output: Any) -> None:
        _replay.topk = None

    _install(+1)
    try:
        for layer, router in routers.items():
            handles.append(router.register_forward_pre_hook(arm(layer)))
            handles.append(router.register_forward_hook(disarm))
        yield
    finally:
        _replay.topk = None
        _install(-1)
        for handle in handles:
            handle.remove()


#: torch's own top-k. While a replay is open anywhere, `torch.topk` is `_dispatch`, which answers
#: with the replayed top-k only in the thread whose router is running under one (a thread-local:
#: another thread's forward, e.g. an engine or a model without replay, keeps torch's)
_TOPK = torch.topk
_replay = threading.local()
_open = [0]
_lock = threading.Lock()


def _dispatch(*args: Any, **kwargs: Any) -> Any:
    return (getattr(_replay, "topk", None) or _TOPK)(*args, **kwargs)


def _install(change: int) -> None:
    with _lock:
        _open[0] += change
        torch.topk = _dispatch if _open[0] > 0 else _TOPK  # type: ignore[assignment]


def _replayed_topk(original: Any, experts: Tensor, top_k: int, tally: RoutingTally | None = None) -> Any:
    def topk(values: Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
        if k != top_k or values.dim() != 2 or dim not in (-1, 1):  # another top-k inside the router
            return original(values, k, dim=dim, largest=largest, sorted=sorted)
        if values.shape[0] != experts.shape[0] or experts.shape[1] != k:
            raise RoutingReplayError(
                f"routing replay: the router scores {values.shape[0]} tokens but {experts.shape[0]} "
                f"tokens' routing was given ({experts.shape[1]} experts each, the router picks {k})"
            )
        index = experts.to(values.device)
        missing = (index < 0).any(-1)
        if tally is not None or bool(missing.any()):  # tokens the engine did not route: own top-k
            own = original(values, k, dim=-1, largest=largest, sorted=sorted).indices
            if tally is not None:
                tally.add(own, index, ~missing)
            index = torch.where(missing[:, None], own, index)
        return torch.return_types.topk((values.gather(-1, index), index))

    return topk


def routing_of(model: torch.nn.Module, **inputs: Any) -> Tensor:
    """The experts each router of `model` picks on `inputs`: [tokens, layers, top_k] (a dense
    layer's column is -1), the layout `replay_routing` takes."""
    routers = moe_routers(model)
    picked: dict[int, Tensor] = {}
    handles = [
        router.register_forward_hook(
            lambda module, args, output, layer=layer: picked.__setitem__(layer, output[2].detach())
        )
        for layer, router in routers.items()
    ]
    try:
        with torch.no_grad():
            model(**inputs)
    finally:
        for handle in handles:
            handle.remove()
    first = next(iter(picked.values()))
    out = torch.full((first.shape[0], max(routers) + 1, first.shape[1]), -1, dtype=torch.long)
    for layer, experts in picked.items():
        out[:, layer] = experts.cpu()
    return out


def batch_routing(batch: SequenceBatch) -> Tensor | None:
    """The routing of `batch`'s rows on its padded positions, flattened row-major as the routers
    see the tokens of a padded forward: [rows * width, layers, top_k], -1 at padding and in rows
    without routing. None when no row carries any."""
    rows = batch.row_inputs
    given = [None if rows is None else rows[i].get(ROUTED_EXPERTS) for i in range(batch.batch_size)]
    ref = next((g for g in given if g is not None), None)
    if ref is None:
        return None
    b, width = batch.input_ids.shape
    out = torch.full((b, width, *ref.shape[1:]), -1, dtype=torch.long, device=batch.input_ids.device)
    for i, routed in enumerate(given):
        if routed is None:
            continue
        positions = batch.attention_mask[i].nonzero().squeeze(-1)
        if tuple(routed.shape) != (len(positions), *ref.shape[1:]):
            raise RoutingReplayError(
                f"routing replay: batch row {i} has {len(positions)} tokens but routed experts of shape "
                f"{tuple(routed.shape)} (want [{len(positions)}, {', '.join(map(str, ref.shape[1:]))}])"
            )
        out[i, positions] = routed.to(out.device).long()
    return out.reshape(b * width, *ref.shape[1:])


def replayed(
    model: torch.nn.Module, batch: SequenceBatch, tally: RoutingTally | None = None
) -> contextlib.AbstractContextManager[None]:
    """The context a padded forward of `batch` replays its rows' routing in (`batch_routing`),
    counting into `tally`; a no-op when no row carries routing."""
    routed = batch_routing(batch)
    return contextlib.nullcontext() if routed is None else replay_routing(model, routed, tally)


def routing_row(row: dict[str, Any] | None, routed: Any) -> dict[str, Any] | None:
    """A row's `row_inputs` (`row`: its image inputs, or None) with its routed experts `routed`
    (array-like [tokens, layers, top_k], -1 where not routed; None: none)."""
    if routed is None:
        return row
    return {**(row or {}), ROUTED_EXPERTS: torch.as_tensor(routed).long()}


__all__ = [
    "ROUTED_EXPERTS",
    "RoutingReplayError",
    "batch_routing",
    "moe_routers",
    "replay_routing",
    "replayed",
    "routing_of",
    "routing_row",
]
