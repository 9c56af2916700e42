"""`WeightSender`: pushes the weights of this process to any number of inference engines.

It holds both halves of weight sync (`weight_sync.broadcast.broadcaster` and `weight_sync.control`) in one
torch process, which is rank 0 of the weight-update group; each engine's workers take the ranks
after it (a training run splits the halves: the policy's rank 0 broadcasts, the driver calls the
engines, `cluster.engine_weights`). By default a sync is one weight stream
(`weight_sync.broadcast.stream`): each engine is called once (the broadcast transport's ``stream``) while this process
broadcasts every bucket with its metadata in band, packing bucket k+1 while bucket k is on the
wire. The sequential path (`overlap=False`) tells every engine the metadata of one bucket at a
time (`update_weights`) while it broadcasts that bucket's flat buffers; both happen concurrently
because each side blocks until the other arrives.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from skylift.utils.calls import call_with_timeout
from skylift.utils.devices import Backend
from skylift.utils.memory import release_free_heap
from skylift.utils.network import route_address, url_host
from skylift.weight_sync.broadcast.broadcaster import WeightBroadcaster
from skylift.weight_sync.buckets import NamedTensor, iter_buckets, pack_bucket
from skylift.weight_sync.control import EngineGroup
from skylift.weight_sync.process_group import WeightSyncError, WeightSyncGroup
from skylift.weight_sync.protocol import DEFAULT_GROUP_NAME, WeightSyncTarget

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 1024 * 1024


@dataclass
class SyncStats:
    """What one `send_state_dict` moved and how long it took."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    seconds: float = 0.0
    bucket_seconds: list[float] = field(default_factory=list)  # sequential path only
    overlapped: bool = False  # sent as one weight stream (`weight_sync.broadcast.stream`)
    receipts: list[Any] = field(default_factory=list)  # each engine's answer to the stream


def weight_sync_master_address(override: str | None, remote_urls: Sequence[str], node_ip: str) -> str:
    """The address the weight-update group's store listens on and the engines dial.

    `override` (`generator.weight_sync_master_address`) wins. With remote engines it is this
    host's address on the route to the first engine's host (127.0.0.1 for an engine on loopback);
    with local engines `node_ip`, the sender's node as the cluster knows it.
    """
    if override:
        return override
    if not remote_urls:
        return node_ip
    routes = {url: route_address(url_host(url)) for url in remote_urls}
    chosen = routes[remote_urls[0]]
    others = {url: a for url, a in routes.items() if a != chosen}
    if others:
        logger.warning(
            "weight sync: engines are reached from different local addresses (%s for %s, %s); the group "
            "listens on %s (set generator.weight_sync_master_address to choose)",
            chosen,
            remote_urls[0],
            ", ".join(f"{a} for {u}" for u, a in others.items()),
            chosen,
        )
    return chosen


class WeightSender:
    """Both halves of weight sync in one process: a `WeightBroadcaster` (rank 0 here) and the
    `EngineGroup` of the engines it sends to. Creates the group, streams state dicts, destroys it.

    `timeout_s` bounds the group's rendezvous and each collective; `update_timeout_s` bounds one
    engine call end to end (metadata, broadcast and the engines' reload): a bucket, or with
    `overlap` the whole stream.

    `overlap` (default): one weight stream per sync (`weight_sync.broadcast.stream`): one call to each
    engine, bucket k+1 packed while bucket k is on the wire and broadcast while the engines reload
    bucket k. False: the sequential path, one ``bucket`` call per bucket, each bucket loaded
    before the next is sent.
    """

    def __init__(
        self, *, timeout_s: float = 120.0, update_timeout_s: float = 600.0, overlap: bool = True
    ) -> None:
        self.timeout_s = timeout_s
        self.update_timeout_s = update_timeout_s
        self.overlap = overlap
        self.rank_zero = WeightBroadcaster(timeout_s=timeout_s, update_timeout_s=update_timeout_s)
        self._engines: EngineGroup | None = None

    @property
    def group(self) -> WeightSyncGroup | None:
        """This side's live group, or None before `init_group` / after `close`."""
        return self.rank_zero.group

    async def _local(self, operation: str, fn: Any, *args: Any, timeout_s: float) -> Any:
        return await call_with_timeout(
            "sender (rank 0)",
            operation,
            asyncio.to_thread(fn, *args),
            timeout_s,
            timeout_error=WeightSyncError,
        )

    async def init_group(
        self,
        engines: Sequence[WeightSyncTarget],
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: Backend | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        override_existing: bool = False,
    ) -> None:
        """Create the group with every engine (rank 0 here, engine workers after it).

        `master_port=None` lets the OS choose a free port for the store this process hosts.
        `backend=None` means nccl with CUDA, else gloo. All rendezvous run concurrently.
        """
        if self.group is not None:
            raise WeightSyncError("this sender already has a group: call close() first")
        group = EngineGroup(engines, timeout_s=self.timeout_s, update_timeout_s=self.update_timeout_s)

        async def host(world_size: int) -> tuple[str, int, str]:
            port = self.rank_zero.host(master_address, world_size, backend, group_name, master_port)
            return master_address, port, self.rank_zero.backend

        def join() -> Awaitable[None]:
            return asyncio.to_thread(self.rank_zero.join)

        try:
            await group.open(host, join, override_existing=override_existing, group_name=group_name)
        except BaseException:  # also ends rank 0's rendezvous if it still waits
            self.rank_zero.close()
            raise
        self._engines = group

    async def send_state_dict(
        self,
        named_tensors: Iterable[NamedTensor],
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        overlap: bool | None = None,
    ) -> SyncStats:
        """Stream `named_tensors` (Hugging Face names) to every engine in size-bounded buckets.

        Returns when every engine has loaded every bucket (and reset its prefix cache).
        `overlap`: this sync's path (None: the sender's `overlap`; see the class).
        """
        group, engines = self.rank_zero.require_group(), self._require_engines()
        overlap = self.overlap if overlap is None else overlap
        start = time.perf_counter()
        if overlap:
            broadcast = asyncio.to_thread(self.rank_zero.broadcast_stream, named_tensors, bucket_bytes)
            sent, receipts = await engines.receive_stream(broadcast)
            return SyncStats(
                buckets=sent.buckets,
                tensors=sent.tensors,
                bytes=sent.bytes,
                seconds=time.perf_counter() - start,
                overlapped=True,
                receipts=receipts,
            )
        try:
            return await self._send_buckets(group.device, engines, named_tensors, bucket_bytes, start)
        finally:
            release_free_heap()  # the packed and cast copies of this sync (see release_free_heap)

    async def _send_buckets(
        self,
        device: torch.device,
        engines: EngineGroup,
        named_tensors: Iterable[NamedTensor],
        bucket_bytes: int,
        start: float,
    ) -> SyncStats:
        stats = SyncStats()
        buckets = iter_buckets(named_tensors, bucket_bytes)

        def pack_next() -> asyncio.Future[Any] | None:
            items = next(buckets, None)
            if items is None:
                return None
            return asyncio.ensure_future(
                self._local("packing a bucket", pack_bucket, items, device, timeout_s=self.update_timeout_s)
            )

        # Pipelined: the next bucket is packed while the current one is broadcast and loaded.
        pending = pack_next()
        try:
            while pending is not None:
                t0 = time.perf_counter()
                bucket, buffers = await pending
                pending = pack_next()
                broadcast = asyncio.to_thread(self.rank_zero.broadcast_buffers, buffers)
                await engines.receive_bucket(bucket, broadcast)
                stats.buckets += 1
                stats.tensors += len(bucket.names)
                stats.bytes += sum(b.numel() * b.element_size() for b in buffers)
                stats.bucket_seconds.append(time.perf_counter() - t0)
                del buffers
        finally:
            if pending is not None and not pending.done():
                pending.cancel()
        stats.seconds = time.perf_counter() - start
        return stats

    async def close(self) -> None:
        """Destroy the group on every engine and here (engines first; errors are collected)."""
        engines, self._engines = self._engines, None
        if engines is None:
            self.rank_zero.close()
            return

        async def leave() -> None:
            self.rank_zero.close()

        await engines.close(leave)

    def _require_engines(self) -> EngineGroup:
        if self._engines is None:
            raise WeightSyncError("no weight-update group: call init_group(engines) first")
        return self._engines
