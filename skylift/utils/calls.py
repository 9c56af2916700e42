"""Calls across a process or network boundary: one deadline wrapper, one concurrent fan-out.

`call_with_timeout` is the one wrapper for engine calls, RPCs, Ray actors and the weight-sync
group: every failure names who was asked to do what. Callers choose the error types, so that a
pool can tell an engine that is gone (take it out, retry elsewhere) from one that refused.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

#: How a failure is reported: an exception class for every failure, or a function that builds the
#: exception from the message (``"{who}: {what} failed"``) and the cause (None: raise the cause).
ErrorChoice = type[Exception] | Callable[[str, Exception], Exception | None] | None


async def call_with_timeout(
    who: str,
    what: str,
    awaitable: Awaitable[T],
    timeout_s: float,
    *,
    timeout_error: type[Exception] = TimeoutError,
    error: ErrorChoice = None,
    keep: tuple[type[BaseException], ...] = (),
) -> T:
    """The result of `awaitable`, or an exception whose message starts ``"{who}: {what}"``.

    No answer within `timeout_s` raises `timeout_error`; another failure is raised as `error`
    chooses, except the types in `keep`, which pass unchanged. Cancellation always passes.
    """
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError as exc:
        raise timeout_error(f"{who}: {what} gave no answer within {timeout_s:.0f} s") from exc
    except Exception as exc:
        if isinstance(exc, keep) or error is None:
            raise
        message = f"{who}: {what} failed"
        failure = error(f"{message}: {exc}") if isinstance(error, type) else error(message, exc)
        if failure is None:
            raise
        raise failure from exc


async def gather_all(awaitables: Sequence[Awaitable[Any]], *, fail_fast: bool = False) -> list[Any]:
    """Run concurrently; each result or the exception it raised, in order.

    With `fail_fast`, the first failure cancels the rest and is raised (for calls that are
    pointless once one failed, such as the ranks of one collective)."""
    futures = [asyncio.ensure_future(a) for a in awaitables]
    if not fail_fast:
        return list(await asyncio.gather(*futures, return_exceptions=True))
    try:
        done, _ = await asyncio.wait(futures, return_when=asyncio.FIRST_EXCEPTION)
        for fut in futures:
            if fut in done and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]
        return [f.result() for f in futures]
    finally:
        for fut in futures:
            if not fut.done():
                fut.cancel()
        await asyncio.gather(*futures, return_exceptions=True)
