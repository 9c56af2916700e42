"""`PolicySync`: the driver's end of a weight-update group between the policy and the engines
(what `BroadcastTransport` sends over; `weight_sync.lora.transport.LoraPolicySync` is the LoRA
transport's, with the adapter as its payload).

One owner per job: the policy's ranks produce the weights and rank 0 broadcasts them
(`RLWorker`, over its `WeightBroadcaster`); this driver-side object owns the engine clients of
the weight-update group (`weight_sync.control.EngineGroup`) and tells those engines to join, to
receive and to leave, each time concurrently with the matching call on the policy (run in a
thread: a Ray call or an in-process rank). Which engines are alive is the pool's to say
(`broadcast.transport` builds the group over the pool's live engines).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from typing import Any, Protocol

from skylift.weight_sync.control import EngineGroup
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.protocol import WeightSyncTarget

logger = logging.getLogger(__name__)


class PolicyRanks(Protocol):
    """The policy's weight-sync calls (`skylift.cluster.worker_group.WorkerGroup`: each blocks while
    the policy's ranks work; the driver runs them in threads)."""

    def host_weight_group(self, *args: Any) -> tuple[str, int, str]: ...
    def join_weight_group(self) -> None: ...
    def close_weight_group(self) -> None: ...
    def broadcast_weights(self, dtype: str | None) -> dict[str, float]: ...


class PolicySync:
    """The weight-update group policy rank 0 -> `engines`, seen from the driver.

    A sync broadcasts the policy's full weights (`weight_sync.lora.transport.LoraPolicySync`: its
    LoRA adapter). `timeout_s` bounds the rendezvous and each
    engine call of a sync; `master_address` None: derived on rank 0 (see `RLWorker.host_weight_group`).
    """

    def __init__(
        self,
        policy: PolicyRanks,
        *,
        backend: str | None = None,
        timeout_s: float = 120.0,
        master_address: str | None = None,
    ) -> None:
        self.policy = policy
        self.backend, self.timeout_s, self.master_address = backend, timeout_s, master_address
        self.group: EngineGroup | None = None

    @property
    def members(self) -> list[WeightSyncTarget]:
        """The engines in the live group (none before `open` / after `close`)."""
        return list(self.group.engines) if self.group is not None else []

    async def open(self, engines: Sequence[WeightSyncTarget], override_existing: bool = False) -> str:
        """Build the group over `engines`; returns the address they dialled (rank 0's store)."""
        if self.group is not None:
            raise WeightSyncError("the weight-update group is open: close() it first")
        group = EngineGroup(engines, timeout_s=self.timeout_s, update_timeout_s=self.timeout_s)
        urls = [str(url) for e in engines if (url := getattr(e, "url", None))]

        async def host(world_size: int) -> tuple[str, int, str]:
            return await asyncio.to_thread(
                self.policy.host_weight_group,
                world_size,
                urls,
                self.backend,
                self.timeout_s,
                self.master_address,
            )

        try:
            address = await group.open(
                host,
                lambda: asyncio.to_thread(self.policy.join_weight_group),
                override_existing=override_existing,
            )
        except BaseException:  # rank 0 may still wait in the rendezvous: closing its side ends it
            await asyncio.to_thread(self.policy.close_weight_group)
            raise
        self.group = group
        return address

    def require_group(self) -> EngineGroup:
        if self.group is None:
            raise WeightSyncError("no weight-update group: open() it before a sync")
        return self.group

    async def push(self, dtype: str | None = None) -> dict[str, float]:
        """One sync: the engines receive while the policy broadcasts. Returns the sync's metrics."""
        group = self.require_group()
        started = time.perf_counter()
        metrics, _ = await group.receive_stream(asyncio.to_thread(self.policy.broadcast_weights, dtype))
        return {**metrics, "timing/weight_sync_s": time.perf_counter() - started}

    async def close(self) -> None:
        """Destroy the group on the engines, then on rank 0; engines that cannot be reached any
        more (they failed) are logged, not raised."""
        group, self.group = self.group, None
        if group is None:
            await asyncio.to_thread(self.policy.close_weight_group)
            return
        try:
            await group.close(lambda: asyncio.to_thread(self.policy.close_weight_group))
        except WeightSyncError as exc:
            logger.warning("closing the weight-update group: %s", exc)
