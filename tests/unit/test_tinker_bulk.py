"""One request's bulk CPU work (inflating a large zstd body) past its first 8 MiB runs at a lower
priority, so it cannot take the CPU from the threads that serve every user."""

from __future__ import annotations

import asyncio
import os
import threading

import pytest
import zstandard

from skylift.tinker import bulk, limits
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
    used: list[int] = []
    run_bulk = limits.run_bulk

    async def recording(fn, *args):  # type: ignore[no-untyped-def]
        used.append(len(args[1]))  # bytes already inflated when the bulk threads take over
        return await run_bulk(fn, *args)

    monkeypatch.setattr(limits, "run_bulk", recording)
    assert asyncio.run(limits.decompress_zstd(packed, 64 << 20, "/forward_backward")) == body
    assert used == ([] if size_mib * (1 << 20) <= bulk.BULK_AFTER_BYTES else [bulk.BULK_AFTER_BYTES])


def test_past_the_cap_is_a_413_whichever_thread_reads_it() -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (24 << 20))
    for cap in (4 << 20, 16 << 20):  # caught in the first part, and on the bulk threads
        with pytest.raises(TooLargeError, match="the decompressed body"):
            asyncio.run(limits.decompress_zstd(bomb, cap, "/forward_backward"))
