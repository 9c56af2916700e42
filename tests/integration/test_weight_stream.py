"""The weight stream between two ranks of a real gloo group (no engine): what rank 0 packs and
broadcasts arrives bit for bit, in order, at most two buckets ahead of the consumer; a consumer
that gives up still lets rank 0 finish; a dead sender is a timeout naming both ends."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from skylift.weight_sync.broadcast.stream import (
    BucketStream,
    broadcast_stream,
    decode_header,
    encode_header,
    packed_buckets,
)
from skylift.weight_sync.buckets import BufferArena, unpack_bucket
from skylift.weight_sync.process_group import WeightSyncError, create_weight_sync_group, find_free_port

pytestmark = pytest.mark.integration

TIMEOUT_S = 20.0


def state_dict() -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    out = []
    for layer in range(4):
        out.append((f"model.layers.{layer}.mlp.up_proj.weight", torch.randn(64, 32, generator=gen)))
        out.append(
            (f"model.layers.{layer}.mlp.up_proj.bias", torch.randn(64, generator=gen).to(torch.bfloat16))
        )
    out.append(("model.norm.weight", torch.randn(32, generator=gen)))
    return out


def arenas(group):  # type: ignore[no-untyped-def]
    return [BufferArena(group.device) for _ in range(2)]


def two_ranks(sender, receiver):  # type: ignore[no-untyped-def]
    port = find_free_port()

    def member(rank: int):  # type: ignore[no-untyped-def]
        group = create_weight_sync_group(
            master_address="127.0.0.1",
            master_port=port,
            rank=rank,
            world_size=2,
            group_name="stream",
            backend="gloo",
            timeout_s=TIMEOUT_S if rank == 0 else 2.0,
        )
        try:
            return (sender if rank == 0 else receiver)(group)
        finally:
            group.destroy()

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(member, r) for r in (0, 1)]
        return [f.result() for f in futures]


def test_header_round_trip() -> None:
    from skylift.weight_sync.protocol import WeightBucket

    bucket = WeightBucket(names=["a.w", "a.b"], dtypes=["float32", "bfloat16"], shapes=[[2, 3], [3]])
    assert decode_header(encode_header(bucket)) == bucket
    with pytest.raises(WeightSyncError, match="invalid bucket header from rank 0"):
        decode_header(torch.frombuffer(bytearray(b'{"names": ["x"]}'), dtype=torch.uint8))


def test_stream_arrives_bit_for_bit_and_bounded(loopback_only: None) -> None:
    state = state_dict()
    ahead: list[int] = []

    def send(group):  # type: ignore[no-untyped-def]
        return broadcast_stream(group, packed_buckets(state, 8 * 1024, arenas(group), TIMEOUT_S))

    def receive(group):  # type: ignore[no-untyped-def]
        stream = BucketStream(group)
        got = []
        for i, (bucket, buffers) in enumerate(stream):
            time.sleep(0.2)  # a slow reload: the receiver must not run more than one bucket ahead
            ahead.append(stream.stats.buckets - i)
            got.extend((n, t.clone()) for n, t in unpack_bucket(bucket, buffers))
        stream.drain()
        return got, stream.stats

    sent, (received, stats) = two_ranks(send, receive)
    assert sent.buckets == stats.buckets > 2 and sent.bytes == stats.bytes
    assert [n for n, _ in received] == [n for n, _ in state]
    for (_, a), (_, b) in zip(state, received, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert max(ahead) == 2  # double buffer: one bucket in hand, one arrived


def test_consumer_that_stops_still_drains(loopback_only: None) -> None:
    state = state_dict()

    def send(group):  # type: ignore[no-untyped-def]
        return broadcast_stream(group, packed_buckets(state, 8 * 1024, arenas(group), TIMEOUT_S))

    def receive(group):  # type: ignore[no-untyped-def]
        stream = BucketStream(group)
        for _ in stream:
            break  # e.g. a refused bucket
        stream.drain()
        return stream.stats

    sent, stats = two_ranks(send, receive)
    assert sent.buckets == stats.buckets


def test_packing_failure_reaches_the_broadcaster() -> None:
    def tensors():  # type: ignore[no-untyped-def]
        yield "model.layers.0.w", torch.zeros(4)
        raise RuntimeError("gather failed on rank 3")

    packed = packed_buckets(tensors(), 1, [BufferArena(torch.device("cpu"))], TIMEOUT_S)
    with pytest.raises(RuntimeError, match="gather failed on rank 3"):
        list(packed)
    assert not any(t.name == "skylift-weight-pack" for t in threading.enumerate())


def test_silent_sender_times_out_naming_both_ends(loopback_only: None) -> None:
    def send(group):  # type: ignore[no-untyped-def]
        time.sleep(4.0)  # never broadcasts; the receiver's group timeout is 2 s
        return None

    def receive(group):  # type: ignore[no-untyped-def]
        stream = BucketStream(group)
        with pytest.raises(
            WeightSyncError, match="weight stream of group 'stream' from rank 0 to rank 1/2: .*timed out"
        ):
            list(stream)
        return True

    assert two_ranks(send, receive)[1] is True


def test_large_tensors_and_a_long_header_arrive_bit_for_bit(loopback_only: None) -> None:
    from skylift.weight_sync.broadcast.stream import HEADER_BYTES
    from skylift.weight_sync.buckets import pack_bucket

    gen = torch.Generator().manual_seed(1)
    state = [
        ("model.embed_tokens.weight", torch.randn(600, 512, generator=gen)),  # > 1 MB: sent as it is
        ("model.layers.0.mlp.up_proj.weight", torch.randn(512, 520, generator=gen)),
        ("model.layers.0.mlp.up_proj.bias", torch.randn(512, generator=gen).to(torch.bfloat16)),
    ]
    # a header longer than the first frame: its rest follows in one more broadcast
    state += [
        (f"model.layers.1.block_{i:05d}_with_a_long_name.weight", torch.full((2,), float(i)))
        for i in range(2500)
    ]

    def send(group):  # type: ignore[no-untyped-def]
        return broadcast_stream(group, packed_buckets(state, 64 << 20, arenas(group), TIMEOUT_S))

    def receive(group):  # type: ignore[no-untyped-def]
        stream = BucketStream(group)
        got = [(n, t.clone()) for bucket, buffers in stream for n, t in unpack_bucket(bucket, buffers)]
        stream.drain()
        return got

    assert encode_header(pack_bucket(state)[0]).numel() > HEADER_BYTES
    sent, received = two_ranks(send, receive)
    assert sent.buckets == 1 and [n for n, _ in received] == [n for n, _ in state]
    for (_, a), (_, b) in zip(state, received, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b)
