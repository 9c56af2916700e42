"""Giving the heap memory a process has freed back to the operating system."""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's `malloc_trim`, or None where the C library has none (macOS, musl)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        trim = ctypes.CDLL(None).malloc_trim  # the C library this process already runs on
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


def release_free_heap() -> bool:
    """Return the free pages of every malloc arena to the OS; True where that was possible.

    glibc keeps memory freed inside its heaps (each thread that allocates gets an arena of its
    own) for reuse, and returns only what lies at the top of a heap. A weight sync packs and casts
    hundreds of MB on a helper thread every step, so a long run's resident memory grew by those
    freed-but-kept pages step after step. Trimming after each sync keeps it flat; it costs a walk
    over the arenas (milliseconds).
    """
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
