"""`BroadcastTransport`: full weights over a weight-update group; the policy's rank 0 broadcasts,
the engines receive (bucketed, `weight_sync.broadcast.broadcaster` -> `broadcast.receiver`).

The group (`PolicySync`) is built over the set's live engines at `open` and rebuilt whenever the
live set no longer matches its members (the set alone decides which engines are alive); a failed
send probes the engines and is retried once. With no engine left nothing is sent: the push
returns and the next generation stops the run with a checkpoint. `LoraTransport`
(`weight_sync.lora.transport`) is this transport with the adapter as its payload.
"""

from __future__ import annotations

from typing import Any

from skylift.weight_sync.policy_sync import PolicyRanks, PolicySync
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.transport import EngineSet, Say, WeightTransport


class BroadcastTransport(WeightTransport):
    """Full weights over a weight-update group policy rank 0 -> every live engine."""

    def __init__(
        self,
        policy: PolicyRanks,
        engines: EngineSet,
        say: Say,
        *,
        dtype: str | None = None,
        backend: str | None = None,
        timeout_s: float = 120.0,
        master_address: str | None = None,
        override_existing: bool = False,
    ) -> None:
        self.engines, self.say, self.dtype = engines, say, dtype
        self.override_existing = override_existing
        self.link = self.link_class(
            policy, backend=backend, timeout_s=timeout_s, master_address=master_address
        )
        self._broken = False  # a send failed: the group must be rebuilt before the next

    #: the driver's end of the group (a subclass sends another payload over the same group)
    link_class: type[PolicySync] = PolicySync

    @property
    def name(self) -> str:
        """The group's backend where the config forced one ("gloo", "nccl"), else "broadcast"."""
        return self.link.backend or self.kind

    @property
    def members(self) -> list[Any]:
        """The engines in the live group."""
        return self.link.members

    async def open(self) -> str:
        address = await self.link.open(self.engines.engines, self.override_existing)
        return f"weight sync: {len(self.engines.engines)} engine(s) dial {address}"

    async def _send(self) -> dict[str, float]:
        return await self.link.push(self.dtype)

    async def push(self, version: int) -> dict[str, float]:
        for attempt in (1, 2):
            stale = self._broken or self.link.group is None or self.link.members != self._live()
            if stale and not await self._rebuild():
                return {}
            try:
                return await self._send()
            except WeightSyncError as exc:
                if attempt == 2:
                    raise
                self.say(f"weight sync failed ({exc}); checking the engines and retrying once")
                await self.engines.probe()
                self._broken = True  # a new group (or none, when no engine answers)
        return {}

    def _live(self) -> list[Any]:
        return [self.engines.engines[i] for i in self.engines.live_indices]

    async def _rebuild(self) -> bool:
        """A group of the set's live engines only; False when none is left. The old group is
        destroyed first (dead engines failing to answer are logged) and the live engines replace
        their membership."""
        await self.link.close()
        self._broken = False
        live = self._live()
        if not live:
            return False
        self.say(
            f"rebuilding the weight-update group with {len(live)} live engine(s) of {len(self.engines.engines)}"
        )
        await self.link.open(live, override_existing=True)
        return True

    async def close(self) -> None:
        await self.link.close()
