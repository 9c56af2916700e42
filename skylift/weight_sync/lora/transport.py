"""`LoraTransport`: a LoRA policy's adapter under a new name each version
(`weight_sync.lora.adapter`), in memory over the weight-update group or through a directory.

The group is the broadcast transport's (`weight_sync.broadcast.transport`: built over the live
engines, rebuilt when they change, a failed send retried once); what travels is this transport's:
`LoraPolicySync` publishes the adapter (`LoraPublisher`: one new name per sync) instead of
broadcasting the merged weights. Its engine half is `weight_sync.lora.engine`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from skylift.weight_sync.broadcast.transport import BroadcastTransport
from skylift.weight_sync.lora.adapter import LoraPublisher
from skylift.weight_sync.policy_sync import PolicyRanks, PolicySync
from skylift.weight_sync.protocol import WeightBucket
from skylift.weight_sync.transport import EngineSet, Say


class LoraPolicyRanks(PolicyRanks, Protocol):
    """The LoRA policy's calls besides the group's (`skylift.cluster.worker_group.WorkerGroup`)."""

    def stage_lora_adapter(self, dtype: str | None) -> Any: ...
    def broadcast_lora_adapter(self) -> int: ...
    def write_lora_adapter(self, directory: str, dtype: str | None) -> Any: ...


class _PolicyAdapter:
    """The policy's rank 0 as a `weight_sync.lora.adapter.LoraSource` (its blocking calls in threads)."""

    def __init__(self, policy: LoraPolicyRanks, dtype: str | None) -> None:
        self.policy, self.dtype = policy, dtype

    async def stage(self) -> tuple[WeightBucket, dict[str, Any]]:
        return await asyncio.to_thread(self.policy.stage_lora_adapter, self.dtype)

    async def broadcast(self) -> int:
        return await asyncio.to_thread(self.policy.broadcast_lora_adapter)

    async def write(self, directory: str) -> tuple[int, int]:
        return await asyncio.to_thread(self.policy.write_lora_adapter, directory, self.dtype)


class LoraPolicySync(PolicySync):
    """The weight-update group policy rank 0 -> engines, a sync publishing the policy's adapter."""

    policy: LoraPolicyRanks

    def __init__(self, policy: LoraPolicyRanks, **kw: Any) -> None:
        super().__init__(policy, **kw)
        self.publisher = LoraPublisher()

    async def push(self, dtype: str | None = None, lora_sync_path: str | None = None) -> dict[str, float]:
        """One sync: the adapter under a new name, in memory over the group or through
        `lora_sync_path`. Returns the sync's metrics."""
        group = self.require_group()
        started = time.perf_counter()
        stats = await self.publisher.publish_from(group, _PolicyAdapter(self.policy, dtype), lora_sync_path)
        return {
            "timing/weight_sync_s": time.perf_counter() - started,
            "weight_sync/bytes": float(stats.bytes),
        }


class LoraTransport(BroadcastTransport):
    """The policy's LoRA adapter, under a new name per version: over the group, or written to
    `sync_path` and loaded from there by each engine."""

    link_class = LoraPolicySync
    link: LoraPolicySync
    # vLLM keys cached blocks by the adapter's name: base-model blocks stay valid
    needs_prefix_reset = False

    @property
    def name(self) -> str:
        return "lora"

    def __init__(
        self, policy: LoraPolicyRanks, engines: EngineSet, say: Say, *, sync_path: str | None, **kw: Any
    ):
        super().__init__(policy, engines, say, **kw)
        self.sync_path = sync_path

    async def _send(self) -> dict[str, float]:
        return await self.link.push(self.dtype, self.sync_path)
