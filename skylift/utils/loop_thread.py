"""`LoopThread`: a run's one event loop, on a thread of its own for the run's whole life.

Everything asynchronous a run does (the engines' clients, generation, weight sync, evaluation)
happens on this loop; other threads hand it work with `run` (wait for the result) or `submit` (a
future to wait for later, e.g. the next step's rollouts while this step trains). Because the loop
is always running on its own thread, any thread may submit at any time: no caller has to wait for
another's work before touching the loop. Calling `run` from the loop's own thread would wait for
itself, so it raises instead.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

T = TypeVar("T")


class LoopThread:
    """Runs an event loop forever on a daemon thread until `stop()`."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop | None = None,
        name: str = "skylift-loop",
        on_start: Callable[[], None] | None = None,
    ) -> None:
        """`on_start`: called on the new thread before its loop runs (e.g. binding it to cores)."""
        self.loop = loop or asyncio.new_event_loop()
        self._on_start = on_start
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._stopped = False
        self._thread.start()

    def _main(self) -> None:
        if self._on_start is not None:
            self._on_start()
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def closed(self) -> bool:
        return self._stopped

    def on_loop_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule `coro` on the loop; its future (wait with ``.result()``)."""
        if self._stopped:
            coro.close()
            raise RuntimeError(f"the event loop thread {self._thread.name} was stopped")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Run `coro` on the loop and wait for its result (from any thread but the loop's)."""
        if self.on_loop_thread():
            coro.close()
            raise RuntimeError("LoopThread.run called on the loop's own thread: await the coroutine instead")
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except BaseException:
            future.cancel()  # interrupted (Ctrl-C) or timed out: the coroutine does not run on
            raise

    def stop(self, timeout_s: float = 60.0) -> None:
        """Cancel what still runs on the loop, stop it, wait for the thread and close the loop
        (idempotent)."""
        if self._stopped:
            return
        self._stopped = True

        async def cancel_the_rest() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self.loop.shutdown_asyncgens()

        try:
            asyncio.run_coroutine_threadsafe(cancel_the_rest(), self.loop).result(timeout_s)
        except Exception:  # noqa: BLE001 - stopping anyway; the thread join below bounds it
            pass
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise RuntimeError(
                f"the event loop thread {self._thread.name} did not stop within {timeout_s:.0f} s"
            )
        self.loop.close()
