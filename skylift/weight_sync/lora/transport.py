"""`LoraTransport`: a LoRA policy's adapter under a new name each version
(`weight_sync.lora.adapter`), in memory over the weight-update group or through a directory.

It is `BroadcastTransport` (`weight_sync.broadcast.transport`: the group built over the live
engines, rebuilt when they change, a failed send retried once) with the adapter as its payload.
"""

from __future__ import annotations

from typing import Any

from skylift.weight_sync.broadcast.transport import BroadcastTransport
from skylift.weight_sync.policy_sync import PolicyRanks
from skylift.weight_sync.transport import EngineSet, Say


class LoraTransport(BroadcastTransport):
    """The policy's LoRA adapter, under a new name per version: over the group, or written to
    `sync_path` and loaded from there by each engine (`PolicySync` with a `LoraPublisher`)."""

    _lora = True
    # vLLM keys cached blocks by the adapter's name: base-model blocks stay valid
    needs_prefix_reset = False

    def __init__(
        self, policy: PolicyRanks, engines: EngineSet, say: Say, *, sync_path: str | None, **kw: Any
    ):
        super().__init__(policy, engines, say, **kw)
        self.sync_path = sync_path

    async def _send(self) -> dict[str, float]:
        return await self.link.push(self.dtype, self.sync_path)
