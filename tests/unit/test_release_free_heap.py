"""`release_free_heap` gives the pages a thread freed back to the OS (glibc Linux)."""

from __future__ import annotations

import sys
import threading

import pytest

from skylift.utils.memory import _malloc_trim, release_free_heap

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or _malloc_trim() is None, reason="needs glibc's malloc_trim"
)

MIB = 1 << 20


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_pages_freed_on_a_helper_thread_are_returned() -> None:
    kept: list[bytearray] = []

    def allocate_then_free() -> None:
        # 100 KB blocks stay below malloc's mmap threshold, so they live in this thread's arena;
        # the block allocated last stays alive and pins the top of the heap, so free() alone
        # cannot give the freed ones back (as the weight stream's packing thread left them).
        blocks = [bytearray(100_000) for _ in range(2_000)]
        kept.append(bytearray(100_000))
        del blocks

    thread = threading.Thread(target=allocate_then_free)
    thread.start()
    thread.join()
    before = _rss_bytes()
    assert release_free_heap() is True
    after = _rss_bytes()
    assert before - after > 100 * MIB, f"RSS {before / MIB:.0f} MiB -> {after / MIB:.0f} MiB"
