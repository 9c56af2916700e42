"""Stream-safe receive (`weight_sync.broadcast.fence`): a bucket's arena handed back by the consumer
carries an event recorded on its (fake) CUDA stream, and the receive thread waits on it before it
broadcasts the next bucket into that arena; on CPU nothing is recorded."""

from __future__ import annotations

import threading
from typing import Any

import torch

from skylift.weight_sync.broadcast.fence import StreamFence
from skylift.weight_sync.broadcast.stream import BucketStream, broadcast_stream
from skylift.weight_sync.buckets import pack_bucket


class Recording:
    """Rank 0's side: keeps a copy of every tensor broadcast, labelled with its bucket."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[tuple[int | None, torch.Tensor]] = []
        self.bucket: int | None = None

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.sent.append((self.bucket, tensor.clone()))


class Replaying:
    """An engine rank's side: each broadcast receives the next recorded tensor; writes into a
    bucket's buffers are logged."""

    device = torch.device("cpu")
    timeout_s = 5.0
    group_name, rank, world_size = "fake", 1, 2

    def __init__(self, sent: list[tuple[int | None, torch.Tensor]], log: list[tuple]) -> None:
        self.sent, self.log, self.lock = list(sent), log, threading.Lock()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        bucket, data = self.sent.pop(0)
        if bucket is not None and data.numel() != 64 * 1024:  # not a header frame
            with self.lock:
                self.log.append(("write", bucket))
        tensor.copy_(data)


class FakeEvent:
    count = 0

    def __init__(self, log: list[tuple]) -> None:
        FakeEvent.count += 1
        self.id, self.log = FakeEvent.count, log

    def record(self, stream: Any) -> None:
        self.log.append(("record", self.id, stream))

    def synchronize(self) -> None:
        self.log.append(("wait", self.id))


def buckets() -> list[tuple[Any, list[torch.Tensor]]]:
    packed = []
    for k in range(4):
        named = [(f"layer{k}.w", torch.full((8, 4), float(k))), (f"layer{k}.b", torch.arange(4.0) + k)]
        packed.append(pack_bucket(named))
    return packed


def test_an_arena_is_written_again_only_after_the_consumers_event() -> None:
    sender = Recording()

    def labelled() -> Any:
        for k, (bucket, buffers) in enumerate(buckets()):
            sender.bucket = k
            yield bucket, buffers
        sender.bucket = None

    broadcast_stream(sender, labelled())  # type: ignore[arg-type]
    log: list[tuple] = []
    fence = StreamFence(
        torch.device("cpu"), current_stream=lambda: "consumer-stream", new_event=lambda: FakeEvent(log)
    )
    stream = BucketStream(Replaying(sender.sent, log), fence=fence)  # type: ignore[arg-type]
    got = []
    for bucket, buffers in stream:
        got.append((bucket.names, [b.clone() for b in buffers]))
    stream.drain()
    assert [names for names, _ in got] == [[f"layer{k}.w", f"layer{k}.b"] for k in range(4)]
    assert all(torch.equal(bufs[0][:32], torch.full((32,), float(k))) for k, (_, bufs) in enumerate(got))
    records = [e for e in log if e[0] == "record"]
    assert len(records) == 4 and all(stream_name == "consumer-stream" for *_, stream_name in records)
    # two arenas: bucket k >= 2 goes into the arena bucket k - 2 used, after that bucket's event
    for k in (2, 3):
        event = records[k - 2][1]
        recorded, waited = log.index(("record", event, "consumer-stream")), log.index(("wait", event))
        first_write = log.index(("write", k))
        assert recorded < waited < first_write, log
    waits = [e for e in log if e[0] == "wait"]
    assert all(log.index(("record", w[1], "consumer-stream")) < log.index(w) for w in waits)


def test_on_cpu_nothing_is_recorded_or_waited_for() -> None:
    fence = StreamFence(torch.device("cpu"))
    assert fence.record() is None
    StreamFence.wait(None)  # a no-op
