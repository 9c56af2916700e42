"""`DeltaTransport`: the changed tensors of each version, through a shared directory or bucket.

The policy's rank 0 publishes the version (`weight_sync.delta.publish`) and every live engine
host applies it to its store while the engine still generates (`stage`); then each engine loads
what changed and resets its prefix cache (`push`, paused by the caller when requests are in
flight). There is no weight-update group. Engines that fail are taken out by the engine set.
"""

from __future__ import annotations

import asyncio
from typing import Protocol

from skylift.weight_sync.protocol import DeltaPublishSpec, DeltaSyncRequest
from skylift.weight_sync.transport import EngineSet, WeightTransport


class DeltaPolicy(Protocol):
    def publish_delta(self, spec: DeltaPublishSpec, dtype: str | None) -> dict[str, float]: ...


class DeltaTransport(WeightTransport):
    kind = "delta"
    needs_prefix_reset = False  # each engine's load_delta resets its prefix cache

    def __init__(
        self,
        policy: DeltaPolicy,
        engines: EngineSet,
        spec: DeltaPublishSpec,
        *,
        dtype: str | None = None,
        store_dir: str | None = None,
        download_workers: int = 4,
    ) -> None:
        self.policy, self.engines, self.spec, self.dtype = policy, engines, spec, dtype
        self.store_dir = store_dir  # each engine host's store (None: derived from sync_dir)
        self.download_workers = download_workers  # an s3:// or gs:// sync_dir's, per host
        self.staged: DeltaSyncRequest | None = None
        self.published: dict[str, float] = {}

    async def open(self) -> str:
        return f"weight sync: delta versions under {self.spec.sync_dir}"

    async def stage(self, version: int) -> None:
        """Publish the policy's next version; every live engine host fetches it."""
        self.published = await asyncio.to_thread(self.policy.publish_delta, self.spec, self.dtype)
        self.staged = DeltaSyncRequest(
            int(self.published["weight_sync/delta_version"]),
            self.spec.sync_dir,
            self.store_dir,
            self.download_workers,
        )
        await self.engines.weight_call("delta", "fetch", self.staged.to_dict(), strict=False)

    async def push(self, version: int) -> dict[str, float]:
        if self.staged is None:
            raise RuntimeError("DeltaTransport.push before stage: nothing published to load")
        request, self.staged = self.staged, None
        await self.engines.weight_call("delta", "load", request.to_dict(), strict=False)
        return self.published

    @property
    def pending_version(self) -> int | None:
        """The delta version staged and not yet loaded (None: nothing pending)."""
        return self.staged.version if self.staged is not None else None

    async def close(self) -> None:
        self.staged = None
