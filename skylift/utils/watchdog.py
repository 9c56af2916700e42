"""A call that ends as soon as what it waits on is known to be gone.

A client library may learn that its server died (a flag its monitor thread sets) and still leave
some waiting calls unanswered: vLLM fails only the requests its output handler had registered
when it noticed, and never answers a utility call (collective_rpc, pause, ...) that was in
flight. `unless_failed` races such a call against that knowledge, so the caller hears of the
death within `poll_s`, not at its timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: How long a call cancelled because its server died may take to unwind (its own clean-up).
UNWIND_S = 2.0


async def unless_failed(
    awaitable: Awaitable[T], failure: Callable[[], BaseException | None], poll_s: float = 0.2
) -> T:
    """The result of `awaitable`, or the exception `failure()` returns as soon as it returns one
    (asked every `poll_s` while the call runs); the call is then cancelled."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            exc = failure()
            if exc is not None:
                raise exc
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task}, timeout=UNWIND_S)
        if task.done() and not task.cancelled():
            with contextlib.suppress(BaseException):
                task.exception()  # retrieved: no "exception was never retrieved" at exit
