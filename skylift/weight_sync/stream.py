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
`depth` buckets ahead of the consumer, vLLM's ONE `reload_weights` of the sync, which loads each
layer as soon as its tensors have arrived. vLLM's engine core runs no model step while a
`collective_rpc` is executing, so no request is ever served by a half-updated model: requests
wait for the whole swap.
"""

from __future__ import annotations

import json
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from skylift.weight_sync.buckets import (
    NamedTensor,
    allocate_buffers,
    iter_buckets,
    pack_bucket,
    validate_bucket,
)
from skylift.weight_sync.process_group import WeightSyncError, WeightSyncGroup
from skylift.weight_sync.protocol import WeightBucket

#: Buckets the engine holds at once: one being reloaded, one arriving (a double buffer).
STREAM_DEPTH = 2

Packed = tuple[WeightBucket, list[torch.Tensor]]


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
    named_tensors: Iterable[NamedTensor], bucket_bytes: int, device: torch.device, timeout_s: float
) -> Iterator[Packed]:
    """The packed buckets of a state dict, each packed in a thread while the previous one is used.

    Pulling `named_tensors` (gathers, casts) happens in that thread too, off the broadcast's path.
    """
    buckets = iter_buckets(named_tensors, bucket_bytes)
    ready: queue.Queue[Packed | BaseException | None] = queue.Queue(maxsize=1)
    stop = threading.Event()

    def produce() -> None:
        try:
            for items in buckets:
                packed = pack_bucket(items, device)
                while not stop.is_set():
                    try:
                        ready.put(packed, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
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
            yield item
    finally:
        stop.set()
        while thread.is_alive():  # unblock a producer waiting on a full queue
            try:
                ready.get_nowait()
            except queue.Empty:
                thread.join(0.1)


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
    """Engine side: receives the buckets of one stream in a thread, at most `depth` ahead.

    Iterate over it for `(bucket, buffers)`; a bucket's slot is freed when the consumer asks for
    the next one. `drain()` receives whatever is left without handing it out (so rank 0's
    broadcasts complete after the consumer gave up). Every wait is bounded by the group's timeout.
    """

    def __init__(self, group: WeightSyncGroup, depth: int = STREAM_DEPTH) -> None:
        self.group = group
        self.stats = StreamStats()
        self.receive_s = 0.0
        self._queue: queue.Queue[object] = queue.Queue()
        self._slots = threading.Semaphore(depth)
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
            while True:
                if not self._slots.acquire(timeout=timeout_s):
                    raise WeightSyncError(
                        f"{self._where()}: the reload held both buffers for {timeout_s:.0f} s"
                    )
                start = time.perf_counter()
                bucket = self._receive_header()
                if bucket is None:
                    self._queue.put(_END)
                    return
                buffers = allocate_buffers(bucket, self.group.device)
                for buf in buffers:
                    self.group.broadcast(buf)
                self.receive_s += time.perf_counter() - start
                self.stats.buckets += 1
                self.stats.tensors += len(bucket.names)
                self.stats.bytes += sum(b.numel() * b.element_size() for b in buffers)
                self._queue.put((bucket, buffers))
        except WeightSyncError as exc:
            self._queue.put(WeightSyncError(f"{self._where()}: {exc}"))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer, which raises it
            self._queue.put(exc)

    def _next(self) -> Packed | None:
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
            try:
                yield item
            finally:
                del item
                self._slots.release()

    def drain(self) -> None:
        """Receive the rest of the stream without handing it out; raises a receive failure."""
        while not self._done:
            if self._next() is not None:
                self._slots.release()
        self._thread.join(self.group.timeout_s)
