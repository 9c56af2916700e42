"""Bulk CPU work of one request at a lower priority than the threads that serve everyone.

A 256 MiB zstd body takes about a second of CPU to inflate. On a small machine the Tinker server's
threads share its cores (docs/serving_limits.md), so at normal priority that second is taken from
the training thread and the HTTP loop, and every user's requests stall behind one user's body. A
request's first `BULK_AFTER_BYTES` of such work therefore run in asyncio's default threads as
usual (every ordinary body fits), and the rest in `BULK_THREADS` threads of their own whose nice
value is `BULK_NICE` higher: they use whatever CPU the shared threads leave.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

#: work of one request beyond this many bytes goes to the low-priority threads
BULK_AFTER_BYTES = 8 << 20
BULK_THREADS = 2
BULK_NICE = 10

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _lower_priority() -> None:
    """Raise the calling thread's nice value by `BULK_NICE` (on Linux `os.nice` is per thread)."""
    try:
        os.nice(BULK_NICE)
    except (OSError, AttributeError):  # not permitted, or no nice on this platform: normal priority
        pass


def bulk_pool() -> ThreadPoolExecutor:
    """The low-priority threads (started on first use)."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(BULK_THREADS, "tinker-bulk", initializer=_lower_priority)
        return _pool


async def run_bulk(fn: Callable[..., T], *args: object) -> T:
    """`fn(*args)` on a low-priority thread."""
    return await asyncio.get_running_loop().run_in_executor(bulk_pool(), fn, *args)
