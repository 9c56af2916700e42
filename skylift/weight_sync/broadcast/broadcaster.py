"""`WeightBroadcaster`: rank 0 of the weight-update group, the producing side and nothing else.

It hosts the group's store, joins the group and broadcasts (a weight stream, or flat bucket
buffers); it never calls an engine. Whoever owns the engines (`weight_sync.control.EngineGroup`:
the driver in a training run, `WeightSender` in one process) tells them to join and to receive,
concurrently with these blocking calls, which run in the policy's rank 0 (a Ray actor's thread)
or in a thread of the sender's process.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist

from skylift.utils.devices import Backend, default_backend
from skylift.utils.memory import release_free_heap
from skylift.weight_sync.broadcast.stream import STREAM_DEPTH, StreamStats, broadcast_stream, packed_buckets
from skylift.weight_sync.buckets import BufferArena, NamedTensor
from skylift.weight_sync.process_group import (
    WeightSyncError,
    WeightSyncGroup,
    announce_ranks,
    create_weight_sync_group,
    group_device,
)
from skylift.weight_sync.protocol import DEFAULT_GROUP_NAME

logger = logging.getLogger(__name__)


class WeightBroadcaster:
    """Rank 0's half of the group: `host`, then `join` (while the engines join), then
    `broadcast_stream` / `broadcast_buffers` (while the engines receive), then `close`.

    `timeout_s` bounds the rendezvous and each collective; `update_timeout_s` the packing of one
    bucket of a weight stream.
    """

    def __init__(self, *, timeout_s: float = 120.0, update_timeout_s: float = 600.0) -> None:
        self.timeout_s = timeout_s
        self.update_timeout_s = update_timeout_s
        self._group: WeightSyncGroup | None = None
        self._pending: dict | None = None  # what `host` prepared for `join`
        #: the hosted store's server, held here alone: `close` drops it, which ends a `join` still
        #: waiting for ranks that will never come (its client connection, `_pending["store"]`,
        #: sees the server gone) instead of leaving it blocked until `timeout_s`
        self._server: dist.TCPStore | None = None
        self._hosting: object | None = None  # a token of the hosted group: `join` sees a `close`
        self._lock = threading.Lock()
        #: pack memory of the weight stream, kept from sync to sync (dropped by `close`)
        self._arenas: list[BufferArena] = []

    @property
    def group(self) -> WeightSyncGroup | None:
        """The live group, or None before `join` / after `close`."""
        return self._group

    def host(
        self,
        master_address: str,
        world_size: int,
        backend: Backend | None = None,
        group_name: str = DEFAULT_GROUP_NAME,
        master_port: int | None = None,
    ) -> int:
        """Host the group's store on `master_address` (`master_port` None: a port the OS picks);
        returns the port the engines dial. `backend` None: nccl with CUDA, else gloo."""
        if self._group is not None or self._pending is not None:
            raise WeightSyncError("this sender already has a group: call close() first")
        backend = backend or default_backend()
        where = f"{master_address}:{master_port or 0}"
        try:
            server = dist.TCPStore(
                master_address,
                master_port or 0,
                world_size,
                is_master=True,
                timeout=timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
            )
            announce_ranks(server, group_name, 1)  # rank 0 is on its way: the engines may join
            port = int(server.port)
            where = f"{master_address}:{port}"
            # rank 0's own connection, which the group uses: a client of `server`, so that
            # dropping the server (`close`) ends whatever this connection still waits for
            store = dist.TCPStore(
                master_address,
                port,
                world_size,
                is_master=False,
                timeout=timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
            )
        except Exception as exc:
            raise WeightSyncError(f"sender: cannot host the group's store on {where}: {exc}") from exc
        logger.info(
            "weight-sync group %r: world size %d at %s:%d (%s)",
            group_name,
            world_size,
            master_address,
            port,
            backend,
        )
        with self._lock:
            self._server, self._hosting = server, object()
            self._pending = dict(
                master_address=master_address,
                master_port=port,
                rank=0,
                world_size=world_size,
                group_name=group_name,
                backend=backend,
                timeout_s=self.timeout_s,
                device=group_device(backend, None),
                store=store,
            )
        return port

    @property
    def backend(self) -> Backend:
        """The backend of the hosted or live group."""
        if self._group is not None:
            return self._group.backend
        if self._pending is None:
            raise WeightSyncError("no weight-update group: host() first")
        return self._pending["backend"]  # type: ignore[no-any-return]

    def join(self) -> None:
        """The rendezvous of the hosted group (blocks until every engine worker joined, at most
        `timeout_s`; a `close` from another thread meanwhile ends it at once with a
        `WeightSyncError`)."""
        with self._lock:
            pending, self._pending, hosting = self._pending, None, self._hosting
        if pending is None:
            raise WeightSyncError("no hosted weight-update group: call host() first (or it was closed)")
        where = f"{pending['master_address']}:{pending['master_port']}"
        try:
            group = create_weight_sync_group(**pending)
        except WeightSyncError as exc:
            if self._hosting is not hosting:
                raise self._closed_while_waiting(where) from exc
            raise
        with self._lock:
            if self._hosting is hosting:
                self._group = group
                return
        group.destroy()  # closed just as the rendezvous completed
        raise self._closed_while_waiting(where)

    def _closed_while_waiting(self, where: str) -> WeightSyncError:
        return WeightSyncError(
            f"rank 0 stopped waiting for the weight-update group at {where}: the group was closed "
            "before every rank joined (an engine failed to join)"
        )

    def broadcast_stream(self, named_tensors: Iterable[NamedTensor], bucket_bytes: int) -> StreamStats:
        """Broadcast `named_tensors` as one weight stream (`weight_sync.broadcast.stream`): bucket k+1 is
        packed (and pulled from `named_tensors`) while bucket k is on the wire."""
        group = self.require_group()
        if not self._arenas:
            self._arenas = [BufferArena(group.device) for _ in range(STREAM_DEPTH)]
        packed = packed_buckets(named_tensors, bucket_bytes, self._arenas, self.update_timeout_s)
        try:
            return broadcast_stream(group, packed)
        finally:
            packed.close()
            release_free_heap()  # the packed and cast copies of this sync (see release_free_heap)

    def broadcast_buffers(self, buffers: Sequence[torch.Tensor]) -> int:
        """Broadcast the flat buffers of one bucket (its metadata went to the engines another way);
        returns the bytes sent."""
        group = self.require_group()
        for buf in buffers:
            group.broadcast(buf, src=0)
        return sum(b.numel() * b.element_size() for b in buffers)

    def close(self) -> None:
        """Destroy this side of the group (the engines leave theirs first; idempotent) and stop
        hosting its store. Callable from another thread while `join` waits: that ends the
        rendezvous (its connection sees the store gone), so nothing is left waiting for engines
        that failed to join."""
        with self._lock:
            group, self._group, self._pending, self._arenas = self._group, None, None, []
            server, self._server, self._hosting = self._server, None, None
        if group is not None:
            group.destroy()
        del server  # the last reference: the store's server stops, its connections close

    def require_group(self) -> WeightSyncGroup:
        if self._group is None:
            raise WeightSyncError("no weight-update group: call init_group(engines) first")
        return self._group
