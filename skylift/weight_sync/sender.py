"""`WeightSender`: pushes a trainer's weights to any number of inference engines.

It runs in one torch process (the policy's rank 0), which is rank 0 of the weight-update group;
each engine's workers take the ranks after it. By default a sync is one weight stream
(`weight_sync.stream`): each engine is called once (`receive_weight_stream`) while this process
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
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from skylift.utils.calls import call_with_timeout, gather_all
from skylift.utils.devices import Backend, default_backend
from skylift.utils.memory import release_free_heap
from skylift.utils.network import route_address, url_host
from skylift.weight_sync.buckets import BufferArena, NamedTensor, iter_buckets, pack_bucket
from skylift.weight_sync.process_group import WeightSyncError, WeightSyncGroup, create_weight_sync_group
from skylift.weight_sync.protocol import (
    DEFAULT_GROUP_NAME,
    WeightBucket,
    WeightSyncTarget,
    WeightUpdateGroupSpec,
)
from skylift.weight_sync.stream import STREAM_DEPTH, StreamStats, broadcast_stream, packed_buckets

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
    overlapped: bool = False  # sent as one weight stream (`weight_sync.stream`)
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


def _describe(index: int, engine: WeightSyncTarget) -> str:
    return f"engine {index} ({engine!r})"


class WeightSender:
    """Rank 0 of the weight-update group: creates it, streams state dicts, destroys it.

    `timeout_s` bounds the group's rendezvous and each collective; `update_timeout_s` bounds one
    engine call end to end (metadata, broadcast and the engines' reload): a bucket, or with
    `overlap` the whole stream.

    `overlap` (default): one weight stream per sync (`weight_sync.stream`): one call to each
    engine, bucket k+1 packed while bucket k is on the wire and broadcast while the engines reload
    bucket k. False: the sequential path, one `update_weights` call per bucket, each bucket loaded
    before the next is sent. Engines without `receive_weight_stream` always get the sequential path.
    """

    def __init__(
        self, *, timeout_s: float = 120.0, update_timeout_s: float = 600.0, overlap: bool = True
    ) -> None:
        self.timeout_s = timeout_s
        self.update_timeout_s = update_timeout_s
        self.overlap = overlap
        self._engines: list[WeightSyncTarget] = []
        self._group: WeightSyncGroup | None = None
        #: pack memory of the weight stream, kept from sync to sync (dropped by `close`)
        self._arenas: list[BufferArena] = []

    @property
    def group(self) -> WeightSyncGroup | None:
        """This side's live group, or None before `init_group` / after `close`."""
        return self._group

    async def _engine_call(
        self, index: int, engine: WeightSyncTarget, operation: str, aw: Awaitable[Any], timeout_s: float
    ) -> Any:
        return await call_with_timeout(
            _describe(index, engine),
            operation,
            aw,
            timeout_s,
            timeout_error=WeightSyncError,
            error=WeightSyncError,
        )

    async def _local(self, operation: str, fn: Any, *args: Any, timeout_s: float) -> Any:
        return await call_with_timeout(
            "sender (rank 0)",
            operation,
            asyncio.to_thread(fn, *args),
            timeout_s,
            timeout_error=WeightSyncError,
        )

    @staticmethod
    async def _all(tasks: Sequence[Awaitable[Any]]) -> list[Any]:
        """Run concurrently; on the first failure cancel the rest and raise it."""
        return await gather_all(tasks, fail_fast=True)

    async def init_group(
        self,
        engines: Sequence[WeightSyncTarget],
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        backend: Backend | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        override_existing: bool = False,
        timeout_s: float | None = None,
    ) -> None:
        """Create the group with every engine (rank 0 here, engine workers after it).

        `master_port=None` lets the OS choose a free port for the store this process hosts.
        `backend=None` means nccl with CUDA, else gloo. All rendezvous run concurrently.
        """
        if self._group is not None:
            raise WeightSyncError("this sender already has a group: call close() first")
        if not engines:
            raise WeightSyncError("init_group needs at least one engine")
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        backend = backend or default_backend()
        tp_sizes = await self._all(
            [
                self._engine_call(i, e, "tensor_parallel_size", e.tensor_parallel_size(), timeout_s)
                for i, e in enumerate(engines)
            ]
        )
        world_size = 1 + sum(tp_sizes)
        offsets = [1 + sum(tp_sizes[:i]) for i in range(len(engines))]
        try:
            store = dist.TCPStore(
                master_address,
                master_port or 0,
                world_size,
                is_master=True,
                timeout=timedelta(seconds=timeout_s),
                wait_for_workers=False,
            )
        except Exception as exc:
            raise WeightSyncError(
                f"sender: cannot host the group's store on {master_address}:{master_port}: {exc}"
            ) from exc
        port = int(store.port)
        device = (
            torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        )
        logger.info(
            "weight-sync group %r: world size %d at %s:%d (%s)",
            group_name,
            world_size,
            master_address,
            port,
            backend,
        )

        own = self._local(
            "group rendezvous",
            lambda: create_weight_sync_group(
                master_address=master_address,
                master_port=port,
                rank=0,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=timeout_s,
                device=device,
                store=store,
            ),
            timeout_s=timeout_s + 10.0,
        )
        joins = [
            self._engine_call(
                i,
                engine,
                "init_weight_update_communicator",
                engine.init_weight_update_communicator(
                    WeightUpdateGroupSpec(
                        master_address=master_address,
                        master_port=port,
                        rank_offset=offsets[i],
                        world_size=world_size,
                        group_name=group_name,
                        backend=backend,
                        override_existing=override_existing,
                        timeout_s=timeout_s,
                    )
                ),
                timeout_s + 30.0,
            )
            for i, engine in enumerate(engines)
        ]
        results = await self._all([own, *joins])
        self._group = results[0]
        self._engines = list(engines)

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
        try:
            return await self._send(named_tensors, bucket_bytes, overlap)
        finally:
            release_free_heap()  # the packed and cast copies of this sync (see release_free_heap)

    async def _send(
        self, named_tensors: Iterable[NamedTensor], bucket_bytes: int, overlap: bool | None
    ) -> SyncStats:
        group = self._require_group()
        overlap = self.overlap if overlap is None else overlap
        if overlap and all(callable(getattr(e, "receive_weight_stream", None)) for e in self._engines):
            return await self._send_stream(group, named_tensors, bucket_bytes)
        stats = SyncStats()
        start = time.perf_counter()
        buckets = iter_buckets(named_tensors, bucket_bytes)

        def pack_next() -> asyncio.Future[Any] | None:
            items = next(buckets, None)
            if items is None:
                return None
            return asyncio.ensure_future(
                self._local(
                    "packing a bucket", pack_bucket, items, group.device, timeout_s=self.update_timeout_s
                )
            )

        # Pipelined: the next bucket is packed while the current one is broadcast and loaded.
        pending = pack_next()
        try:
            while pending is not None:
                t0 = time.perf_counter()
                bucket, buffers = await pending
                pending = pack_next()
                await self._send_bucket(group, bucket, buffers)
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

    async def _send_stream(
        self, group: WeightSyncGroup, named_tensors: Iterable[NamedTensor], bucket_bytes: int
    ) -> SyncStats:
        start = time.perf_counter()
        if not self._arenas:
            self._arenas = [BufferArena(group.device) for _ in range(STREAM_DEPTH)]
        packed = packed_buckets(named_tensors, bucket_bytes, self._arenas, self.update_timeout_s)

        def broadcast() -> StreamStats:
            try:
                return broadcast_stream(group, packed)
            finally:
                packed.close()

        tasks: list[Awaitable[Any]] = [
            self._local("weight stream broadcast", broadcast, timeout_s=self.update_timeout_s)
        ]
        tasks += [
            self._engine_call(i, e, "receive_weight_stream", e.receive_weight_stream(), self.update_timeout_s)
            for i, e in enumerate(self._engines)
        ]
        sent, *receipts = await self._all(tasks)
        return SyncStats(
            buckets=sent.buckets,
            tensors=sent.tensors,
            bytes=sent.bytes,
            seconds=time.perf_counter() - start,
            overlapped=True,
            receipts=receipts,
        )

    async def _send_bucket(
        self, group: WeightSyncGroup, bucket: WeightBucket, buffers: list[torch.Tensor]
    ) -> None:
        def broadcast_all() -> None:
            for buf in buffers:
                group.broadcast(buf, src=0)

        tasks: list[Awaitable[Any]] = [
            self._local("broadcast", broadcast_all, timeout_s=self.update_timeout_s)
        ]
        tasks += [
            self._engine_call(
                i,
                e,
                f"update_weights ({len(bucket.names)} tensors)",
                e.update_weights(bucket),
                self.update_timeout_s,
            )
            for i, e in enumerate(self._engines)
        ]
        await self._all(tasks)

    async def close(self) -> None:
        """Destroy the group on every engine and here (engines first; errors are collected)."""
        group, self._group = self._group, None
        engines, self._engines = self._engines, []
        self._arenas = []
        if group is None:
            return
        results = await gather_all(
            [
                self._engine_call(
                    i, e, "destroy_weights_update_group", e.destroy_weights_update_group(), self.timeout_s
                )
                for i, e in enumerate(engines)
            ]
        )
        group.destroy()
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            raise WeightSyncError("; ".join(str(e) for e in errors))

    def _require_group(self) -> WeightSyncGroup:
        if self._group is None:
            raise WeightSyncError("no weight-update group: call init_group(engines) first")
        return self._group
