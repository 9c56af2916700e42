"""The weight stream: every bucket of one sync over the group, behind ONE call to each engine.

The per-bucket protocol (`WeightSyncTarget.update_weights`) costs a round trip per bucket and
makes the engine reload bucket k before bucket k+1 goes on the wire. The stream instead carries
each bucket's metadata in band, so the engine is called once per sync and the broadcast of
bucket k+1 runs while the engine reloads bucket k:

    for each bucket:  uint8[HEADER_BYTES] frame: an 8-byte little-endian length n, then the
                      header (JSON names/dtypes/shapes/pieces), its rest (if n does not fit) in
                      one more uint8 broadcast
                      ->  the bucket's flat buffers (wire format of `WeightBucket`), cut into the
                      `pieces` of the header: each tensor of 1 MB or more as it is (no copy on
                      the sender), the smaller ones between them copied together
                      (`buckets.wire_pieces`); the receiver receives each piece straight into
                      its slice of the flat buffers
    end of stream:    a frame of length 0

On the sender, `packed_buckets` packs (and casts) bucket k+1 in a thread while bucket k is
broadcast (`broadcast_stream`). On the engine, `BucketStream` receives in a thread at most
`STREAM_DEPTH` buckets ahead of the consumer, vLLM's ONE `reload_weights` of the sync, which loads
each layer as soon as its tensors have arrived. Both ends keep two `BufferArena`s across syncs, so
no bucket pays for fresh memory (the sender's hold only the small tensors it copies together; the
large ones go on the wire from where they are). vLLM's engine core runs no model step while a
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

from skylift.weight_sync.broadcast.fence import StreamFence
from skylift.weight_sync.buckets import (
    BufferArena,
    NamedTensor,
    iter_buckets,
    split_pieces,
    validate_bucket,
    wire_pieces,
)
from skylift.weight_sync.process_group import WeightSyncError, WeightSyncGroup
from skylift.weight_sync.protocol import WeightBucket

#: Buckets the engine holds at once: one being reloaded, one arriving (a double buffer).
STREAM_DEPTH = 2

#: Bytes of the one fixed-size broadcast that opens each bucket (length + header).
HEADER_BYTES = 64 * 1024
_LENGTH_BYTES = 8

Packed = tuple[WeightBucket, list[torch.Tensor]]


def _use_device_in_thread(device: torch.device) -> None:
    """A new thread's current CUDA device is 0: make it the group's (NCCL works on it)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def encode_header(bucket: WeightBucket, pieces: Sequence[int] | None = None) -> torch.Tensor:
    """A bucket's metadata as a uint8 tensor (UTF-8 JSON); `pieces`: the numbers of elements of
    the pieces its flat buffers travel in (None: one piece per buffer)."""
    fields: dict[str, object] = bucket.to_dict()
    if pieces is not None:
        fields["pieces"] = list(pieces)
    raw = json.dumps(fields, separators=(",", ":")).encode()
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def decode_frame(header: torch.Tensor) -> tuple[WeightBucket, list[int] | None]:
    """The bucket a header describes and its pieces (None: one per buffer); `WeightSyncError`
    when it is not a valid bucket."""
    try:
        fields = json.loads(bytes(header.numpy()).decode())
        bucket = validate_bucket(WeightBucket(fields["names"], fields["dtypes"], fields["shapes"]))
        pieces = fields.get("pieces")
        if pieces is not None and not all(isinstance(p, int) for p in pieces):
            raise ValueError(f"pieces must be integers, got {pieces[:5]}")
        return bucket, pieces
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise WeightSyncError(f"weight stream: invalid bucket header from rank 0: {exc}") from exc


def decode_header(header: torch.Tensor) -> WeightBucket:
    """The bucket a header describes; `WeightSyncError` when it is not a valid bucket."""
    return decode_frame(header)[0]


def header_frames(header: torch.Tensor | None) -> list[torch.Tensor]:
    """What rank 0 broadcasts for a header (None: the end of the stream): the fixed-size frame,
    and the header's rest when it does not fit in it."""
    n = 0 if header is None else header.numel()
    frame = torch.zeros(HEADER_BYTES, dtype=torch.uint8)
    frame[:_LENGTH_BYTES] = torch.frombuffer(
        bytearray(n.to_bytes(_LENGTH_BYTES, "little")), dtype=torch.uint8
    )
    room = HEADER_BYTES - _LENGTH_BYTES
    if header is None:
        return [frame]
    frame[_LENGTH_BYTES : _LENGTH_BYTES + min(n, room)] = header[:room]
    return [frame] if n <= room else [frame, header[room:].clone()]


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
                ready.put((wire_pieces(items, arena), arena))
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
    """Rank 0: broadcast every bucket (its header, then its pieces: `Packed` holds the pieces of
    `wire_pieces` or a bucket's whole flat buffers), then the end marker (blocking)."""
    stats = StreamStats()
    for bucket, pieces in packed:
        for frame in header_frames(encode_header(bucket, [p.numel() for p in pieces])):
            group.broadcast(frame.to(group.device))
        for piece in pieces:
            group.broadcast(piece)
        stats.buckets += 1
        stats.tensors += len(bucket.names)
        stats.bytes += sum(p.numel() * p.element_size() for p in pieces)
        del pieces
    group.broadcast(header_frames(None)[0].to(group.device))
    return stats


_END = object()


class BucketStream:
    """Engine side: receives the buckets of one stream in a thread, at most `STREAM_DEPTH` ahead.

    Iterate over it for `(bucket, buffers)`; each bucket is received into a free arena of
    `arenas` (default: two for this stream alone), freed again when the consumer asks for the next
    bucket. `drain()` receives whatever is left without handing it out (so rank 0's broadcasts
    complete after the consumer gave up). Every wait is bounded by the group's timeout. An arena
    handed back carries an event recorded on the consumer's CUDA stream (`fence`), which the
    receive thread waits on before it broadcasts into that arena again (a no-op on CPU).
    """

    def __init__(
        self,
        group: WeightSyncGroup,
        arenas: Sequence[BufferArena] | None = None,
        fence: StreamFence | None = None,
    ) -> None:
        self.group = group
        self.stats = StreamStats()
        self.receive_s = 0.0
        self.fence = fence if fence is not None else StreamFence(group.device)
        self._queue: queue.Queue[object] = queue.Queue()
        self._free: queue.Queue[tuple[BufferArena, object]] = queue.Queue()
        for arena in arenas or [BufferArena(group.device) for _ in range(STREAM_DEPTH)]:
            self._free.put((arena, None))
        self._done = False
        self._thread = threading.Thread(target=self._run, name="skylift-weight-stream", daemon=True)
        self._thread.start()

    def _where(self) -> str:
        g = self.group
        return f"weight stream of group {g.group_name!r} from rank 0 to rank {g.rank}/{g.world_size}"

    def _receive_header(self) -> tuple[WeightBucket, list[int] | None] | None:
        frame = torch.empty(HEADER_BYTES, dtype=torch.uint8, device=self.group.device)
        self.group.broadcast(frame)
        frame = frame.cpu()
        n = int.from_bytes(bytes(frame[:_LENGTH_BYTES].numpy()), "little")
        if n == 0:
            return None
        if n > 1 << 30:
            raise WeightSyncError(f"{self._where()}: header of {n} bytes")
        room = HEADER_BYTES - _LENGTH_BYTES
        header = frame[_LENGTH_BYTES : _LENGTH_BYTES + min(n, room)]
        if n > room:
            rest = torch.empty(n - room, dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(rest)
            header = torch.cat([header, rest.cpu()])
        return decode_frame(header)

    def _run(self) -> None:
        timeout_s = self.group.timeout_s
        try:
            _use_device_in_thread(self.group.device)
            while True:
                try:
                    arena, done = self._free.get(timeout=timeout_s)
                except queue.Empty:
                    raise WeightSyncError(f"the reload held every buffer for {timeout_s:.0f} s") from None
                self.fence.wait(done)  # loads queued on the consumer's stream may still read it
                start = time.perf_counter()
                head = self._receive_header()
                if head is None:
                    self._queue.put(_END)
                    return
                bucket, pieces = head
                buffers = arena.buffers(bucket)
                try:
                    views = buffers if pieces is None else split_pieces(buffers, pieces)
                except ValueError as exc:
                    raise WeightSyncError(f"invalid bucket header from rank 0: {exc}") from None
                for view in views:
                    self.group.broadcast(view)
                del views
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
                self._free.put((arena, self.fence.record()))

    def drain(self) -> None:
        """Receive the rest of the stream without handing it out; raises a receive failure."""
        while not self._done:
            item = self._next()
            if item is not None:
                self._free.put((item[2], None))
        self._thread.join(self.group.timeout_s)
