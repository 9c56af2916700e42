"""One request's bulk CPU work (inflating a large zstd body) past its first 8 MiB runs at a lower
priority, so it cannot take the CPU from the threads that serve every user."""

from __future__ import annotations

import asyncio
import os
import threading
import tracemalloc

import pytest
import zstandard

from skylift.tinker.core import bulk, limits
from skylift.tinker.errors import TooLargeError


def test_bulk_threads_run_at_a_lower_priority() -> None:
    def nice_of_this_thread() -> tuple[int, str]:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id()), threading.current_thread().name

    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    theirs, name = asyncio.run(bulk.run_bulk(nice_of_this_thread))
    assert name.startswith("tinker-bulk")
    assert theirs == min(19, mine + bulk.BULK_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine  # the caller is untouched


@pytest.mark.parametrize("size_mib", [1, 20])
def test_a_body_is_inflated_whole_and_only_a_large_one_goes_to_the_bulk_threads(
    size_mib: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = bytes(range(256)) * (size_mib * 4096)
    packed = zstandard.ZstdCompressor().compress(body)
    used: list[str] = []
    run_bulk = limits.run_bulk

    async def recording(fn, *args):  # type: ignore[no-untyped-def]
        used.append(fn.__name__)
        return await run_bulk(fn, *args)

    monkeypatch.setattr(limits, "run_bulk", recording)
    assert asyncio.run(limits.decompress_zstd(packed, 64 << 20, "/forward_backward")) == body
    large = size_mib * (1 << 20) > bulk.BULK_AFTER_BYTES
    assert used == (["_inflated_size", "_inflate_exactly"] if large else [])


def test_past_the_cap_is_a_413_whichever_thread_reads_it() -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (24 << 20))
    for cap in (4 << 20, 16 << 20):  # caught in the first part, and on the bulk threads
        with pytest.raises(TooLargeError, match="the decompressed body"):
            asyncio.run(limits.decompress_zstd(bomb, cap, "/forward_backward"))


def test_a_bomb_is_counted_without_keeping_what_it_inflates_to() -> None:
    """A body past the cap is refused having allocated one read buffer, not the cap's worth."""
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (48 << 20))
    cap = 32 << 20
    tracemalloc.start()
    try:
        with pytest.raises(TooLargeError, match="the decompressed body"):
            asyncio.run(limits.decompress_zstd(bomb, cap, "/forward_backward"))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak / (1 << 20):.1f} MiB allocated to refuse a bomb"


def test_frames_are_inflated_one_after_another() -> None:
    frames = [zstandard.ZstdCompressor().compress(bytes([i]) * 1000) for i in range(3)]
    out = asyncio.run(limits.decompress_zstd(b"".join(frames), 1 << 20, "/forward_backward"))
    assert out == b"".join(bytes([i]) * 1000 for i in range(3))
    with pytest.raises(TooLargeError):
        asyncio.run(limits.decompress_zstd(b"".join(frames), 2999, "/forward_backward"))
