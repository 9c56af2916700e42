"""Threads of one process that share the GIL: how often the interpreter hands it over.

Overlapped training (one-step-off and fully async) runs the rollouts on a thread of the
trainer's process (with placement `local` also vLLM's client: its per-step output processing
in Python) while the main thread trains. Every torch op releases the GIL and must take it back;
while the other thread runs Python, that takes up to `sys.getswitchinterval()` (5 ms by
default) per op, and a training pass of thousands of ops slows down several times; a shorter
interval brings it close to the training loop alone (benchmarks/RESULTS.md,
fully_async_vs_sync.py). A shorter interval costs the busy thread little: it gets the GIL back
as soon as the op has released it.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

#: The GIL switch interval while the main thread trains beside a busy rollout thread (seconds).
OVERLAP_SWITCH_INTERVAL_S = 0.0005


@contextmanager
def switch_interval(seconds: float = OVERLAP_SWITCH_INTERVAL_S) -> Iterator[float]:
    """Hand the GIL over at least every `seconds` inside the block (a shorter interval already
    set stays); the previous interval comes back afterwards. Yields the interval in force."""
    if seconds <= 0:
        raise ValueError(f"a switch interval must be > 0 seconds, got {seconds}")
    previous = sys.getswitchinterval()
    sys.setswitchinterval(min(previous, seconds))
    try:
        yield sys.getswitchinterval()
    finally:
        sys.setswitchinterval(previous)
