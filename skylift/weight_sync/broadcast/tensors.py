"""`TensorsTransport`: full weights this process holds as tensors -> engines it reaches itself.

The source is not a policy's ranks but a set of Hugging Face-named tensors in this process (a
Tinker sampler's merged weights, the base model's): the caller `put`s the tensors, then `push`es
them as a version. Both halves of the weight-update group live here (`WeightSender`: this process
is rank 0 and tells the engines to receive), so `open` builds the group over the engines it was
given (an in-process `LocalVLLMEngine`, or any `WeightSyncTarget`) and `push` streams the tensors
to every one of them (`WeightSender.send_state_dict`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from skylift.weight_sync.broadcast.sender import WeightSender
from skylift.weight_sync.buckets import NamedTensor
from skylift.weight_sync.protocol import WeightSyncTarget
from skylift.weight_sync.transport import WeightTransport


class TensorsTransport(WeightTransport):
    """Tensors `put` here -> every engine of `engines`, over a group this process hosts."""

    def __init__(self, engines: Sequence[WeightSyncTarget], sender: WeightSender | None = None) -> None:
        self.engines = list(engines)
        self.sender = sender if sender is not None else WeightSender()
        self.staged: list[NamedTensor] | None = None
        self.version: int | None = None  # the version the engines hold (None: what they started with)

    async def open(self) -> str:
        await self.sender.init_group(self.engines)
        return f"weight sync: {len(self.engines)} engine(s) in a weight-update group this process hosts"

    def put(self, tensors: Mapping[str, torch.Tensor] | Iterable[NamedTensor]) -> None:
        """The tensors the next `push` sends (Hugging Face names; replaces any not yet pushed)."""
        named = tensors.items() if isinstance(tensors, Mapping) else tensors
        self.staged = list(named)

    async def push(self, version: int) -> dict[str, float]:
        """Every engine loads the tensors `put` last (and resets its prefix cache); they are
        dropped here once sent."""
        if self.staged is None:
            raise RuntimeError("TensorsTransport.push before put: no tensors to send")
        named, self.staged = self.staged, None
        stats = await self.sender.send_state_dict(named)
        self.version = version
        return {"timing/weight_sync_s": stats.seconds, "weight_sync/bytes": float(stats.bytes)}

    async def close(self) -> None:
        self.staged = None
        await self.sender.close()
