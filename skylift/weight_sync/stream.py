"""The weight stream: every bucket of one sync over the group, behind ONE call to each engine.

The per-bucket protocol (`WeightSyncTarget.update_weights`) costs a round trip per bucket and
makes the engine reload bucket k before bucket k+1 goes on the wire. The stream instead carries
each bucket's metadata in band, so the engine is called once per sync and the broadcast of
bucket k+1 runs while the engine reloads bucket k:

    for each bucket:  int64[1] header length  ->  uint8[n] header (JSON names/dtypes/shapes)
                      ->  the bucket's flat buffers (wire format of `WeightBucket`)
    end of stream:    int64[1] = 0

On the sender, `packed_buckets` packs (and casts) bucket k+1 in a thread while bucket k is
broadcast (`broadcast_stream`). On the engine, `BucketStream` receives in a thread at most
`STREAM_DEPTH` buckets ahead of the consumer, vLLM's ONE `reload_weights` of the sync, which loads
each layer as soon as its tensors have arrived. Both ends keep two `BufferArena`s across syncs, so
no bucket pays for fresh memory. vLLM's engine core runs no model step while a
`collective_rpc` is executing, so no request is ever served by a half-updated model: requests
wait for the whole swap.
"""

from __future__ import annotations

import contextlib
import json
import queue
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch

from skylift.weight_sync.buckets import (
    BufferArena,
    NamedTensor,
    iter_buckets,
    pack_bucket_into,
    validate_bucket,
)
from skylift.weight_sync.process_group import WeightSyncError, WeightSyncGroup
from skylift.weight_sync.protocol import WeightBucket

#: Buckets the engine holds at once: one being reloaded, one arriving (a double buffer).
STREAM_DEPTH = 2

Packed = tuple[WeightBucket, list[torch.Tensor]]


def _use_device_in_thread(device: torch.device) -> None:
    """A new thread's current CUDA device is 0: make it the group's (NCCL works on it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def encode_header(bucket: WeightBucket) -> torch.Tensor:
    """A bucket's metadata as a uint8 tensor (UTF-8 JSON)."""
    raw = json.dumps(bucket.to_dict(), separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_header(header: torch.Tensor) -> WeightBucket:
    """The bucket a header describes; `WeightSyncError` when it is not a valid bucket."""
    try:
        fields = json.loads(bytes(header.numpy()).decode())
        return validate_bucket(WeightBucket(fields["names"], fields["dtypes"], fields["shapes"]))
    except (ValueError, KeyError, TypeError) as exc:
        raise WeightSyncError(f"weight stream: invalid bucket header from rank 0: {exc}") from exc


@dataclass
class StreamStats:
    """What one stream moved (either end)."""

    buckets: int = 0
    tensors: int = 0
    bytes: int = 0


def packed_buckets(
    named_tensors: Iterable[NamedTensor],
    bucket_bytes: int,
    arenas: Sequence[BufferArena],
    timeout_s: float,
) -> Iterator[Packed]:
    """The packed buckets of a state dict, each packed in a thread while the previous one is used.

    Pulling `named_tensors` (gathers, casts) happens in that thread too, off the broadcast's path.
    Each bucket is packed into a free arena of `arenas`, freed again when the consumer asks for
    the next bucket (with two: one is packed while the other is broadcast).
    """
    buckets = iter_buckets(named_tensors, bucket_bytes)
    free: queue.Queue[BufferArena] = queue.Queue()
    for arena in arenas:
        free.put(arena)
    ready: queue.Queue[tuple[Packed, BufferArena] | BaseException | None] = queue.Queue()
    stop = threading.Event()

    def produce() -> None:
        try:
            _use_device_in_thread(arenas[0].device)
            for items in buckets:
                arena = None
                while arena is None:
                    if stop.is_set():
                        return
                    with contextlib.suppress(queue.Empty):
                        arena = free.get(timeout=0.5)
                ready.put((pack_bucket_into(items, arena), arena))
                del items
            ready.put(None)
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            ready.put(exc)

    thread = threading.Thread(target=produce, name="skylift-weight-pack", daemon=True)
    thread.start()
    try:
        while True:
            try:
                item = ready.get(timeout=timeout_s)
            except queue.Empty:
                raise WeightSyncError(
                    f"sender (rank 0): packing the next bucket took longer than {timeout_s:.0f} s"
                ) from None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            packed, arena = item
            del item
            try:
                yield packed
            finally:
                del packed
                free.put(arena)
    finally:
        stop.set()
        thread.join(timeout_s)


def broadcast_stream(group: WeightSyncGroup, packed: Iterable[Packed]) -> StreamStats:
    """Rank 0: broadcast every bucket with its header, then the end marker (blocking)."""
    stats = StreamStats()
    for bucket, buffers in packed:
        header = encode_header(bucket)
        group.broadcast(torch.tensor([header.numel()], dtype=torch.int64, device=group.device))
        group.broadcast(header.to(group.device))
        for buf in buffers:
            group.broadcast(buf)
        stats.buckets += 1
        stats.tensors += len(bucket.names)
        stats.bytes += sum(b.numel() * b.element_size() for b in buffers)
        del buffers
    group.broadcast(torch.zeros(1, dtype=torch.int64, device=group.device))
    return stats


_END = object()


class BucketStream:
    """Engine side: receives the buckets of one stream in a thread, at most `STREAM_DEPTH` ahead.

    Iterate over it for `(bucket, buffers)`; each bucket is received into a free arena of
    `arenas` (default: two for this stream alone), freed again when the consumer asks for the next
    bucket. `drain()` receives whatever is left without handing it out (so rank 0's broadcasts
    complete after the consumer gave up). Every wait is bounded by the group's timeout.
    """

    def __init__(self, group: WeightSyncGroup, arenas: Sequence[BufferArena] | None = None) -> None:
        self.group = group
        self.stats = StreamStats()
        self.receive_s = 0.0
        self._queue: queue.Queue[object] = queue.Queue()
        self._free: queue.Queue[BufferArena] = queue.Queue()
        for arena in arenas or [BufferArena(group.device) for _ in range(STREAM_DEPTH)]:
            self._free.put(arena)
        self._done = False
        self._thread = threading.Thread(target=self._run, name="skylift-weight-stream", daemon=True)
        self._thread.start()

    def _where(self) -> str:
        g = self.group
        return f"weight stream of group {g.group_name!r} from rank 0 to rank {g.rank}/{g.world_size}"

    def _receive_header(self) -> WeightBucket | None:
        size = torch.zeros(1, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(size)
        n = int(size.item())
        if n == 0:
            return None
        if n < 0 or n > 1 << 30:
            raise WeightSyncError(f"{self._where()}: header of {n} bytes")
        header = torch.empty(n, dtype=torch.uint8, device=self.group.device)
        self.group.broadcast(header)
        return decode_header(header.cpu())

    def _run(self) -> None:
        timeout_s = self.group.timeout_s
        try:
            _use_device_in_thread(self.group.device)
            while True:
                try:
                    arena = self._free.get(timeout=timeout_s)
                except queue.Empty:
                    raise WeightSyncError(f"the reload held every buffer for {timeout_s:.0f} s") from None
                start = time.perf_counter()
                bucket = self._receive_header()
                if bucket is None:
                    self._queue.put(_END)
                    return
                buffers = arena.buffers(bucket)
                for buf in buffers:
                    self.group.broadcast(buf)
                self.receive_s += time.perf_counter() - start
                self.stats.buckets += 1
                self.stats.tensors += len(bucket.names)
                self.stats.bytes += sum(b.numel() * b.element_size() for b in buffers)
                self._queue.put((bucket, buffers, arena))
                del buffers
        except WeightSyncError as exc:
            self._queue.put(WeightSyncError(f"{self._where()}: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self._queue.put(exc)

    def _next(self) -> tuple[WeightBucket, list[torch.Tensor], BufferArena] | None:
        wait_s = 2 * self.group.timeout_s + 10.0  # the thread's own waits are bounded by timeout_s
        try:
            item = self._queue.get(timeout=wait_s)
        except queue.Empty:
            raise WeightSyncError(f"{self._where()}: nothing arrived within {wait_s:.0f} s") from None
        if item is _END:
            self._done = True
            return None
        if isinstance(item, BaseException):
            self._done = True
            raise item
        return item  # type: ignore[return-value]

    def __iter__(self) -> Iterator[Packed]:
        while not self._done:
            item = self._next()
            if item is None:
                return
            bucket, buffers, arena = item
            del item
            try:
                yield bucket, buffers
            finally:
                del buffers
                self._free.put(arena)

    def drain(self) -> None:
        """Receive the rest of the stream without handing it out; raises a receive failure."""
        while not self._done:
            item = self._next()
            if item is not None:
                self._free.put(item[2])
        self._thread.join(self.group.timeout_s)
