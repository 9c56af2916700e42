"""Which CPU cores a thread or this whole process may run on (Linux; a no-op elsewhere).

A thread (or process) started later inherits the affinity of the thread that starts it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def bind_this_thread(cpus: Sequence[int]) -> None:
    """Bind the calling thread to `cpus` (on Linux, pid 0 is the calling thread)."""
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, list(cpus))


def bind_this_process(cpus: Sequence[int]) -> None:
    """Bind every thread of this process to `cpus`."""
    if not hasattr(os, "sched_setaffinity"):
        return
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), list(cpus))
        except OSError:  # a thread that ended meanwhile
            pass
