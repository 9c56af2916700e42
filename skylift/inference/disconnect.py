"""Work for an HTTP request that stops when its client goes away (as vLLM's own routes do).

`unless_disconnected` runs an awaitable beside a watcher of the request's ASGI channel; when the
client disconnects first, the work is cancelled (the engine aborts the request's sequences, see
`LocalVLLMEngine._final_output`) and `ClientDisconnected` is raised.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, Protocol, TypeVar

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed its connection before the answer was ready; the work was cancelled."""


class _Receiver(Protocol):
    async def receive(self) -> Any: ...


async def wait_for_disconnect(request: _Receiver) -> None:
    """Return once the client has disconnected (call after the body has been read)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return


async def _cancelled(future: asyncio.Future[Any]) -> None:
    future.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await future


async def unless_disconnected(request: _Receiver, work: Awaitable[T]) -> T:
    """`work`'s result; cancelled, with `ClientDisconnected`, if the client leaves first."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    await _cancelled(watcher)
    if task.done():
        return task.result()
    await _cancelled(task)
    raise ClientDisconnected("the client disconnected: its request was aborted")
