"""Futures: every operation POST returns a request id at once; the result is polled later.

`FutureHub` records each future in the store (so results survive a restart), de-duplicates
repeated POSTs by key (a model's ``seq_id``, a sampler's ``seq_id`` or the client's
``X-Idempotency-Key``), runs the work and long-polls for results. `OrderedQueue` executes one
training model's operations in ``seq_id`` order, one at a time.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from skylift.tinker.errors import error_category, error_message
from skylift.tinker.store import FutureRow, Store

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"

Work = Callable[[], Awaitable[Any]]


class FutureHub:
    """Creates, resolves and waits for futures."""

    def __init__(self, store: Store) -> None:
        self.store = store
        self._events: dict[str, asyncio.Event] = {}
        self._tasks: set[asyncio.Task[Any]] = set()

    def submit(
        self, kind: str, model_id: str | None, dedup_keys: Sequence[str | None] = ()
    ) -> tuple[str, bool]:
        """(request id, True if new). A repeated POST (same key) gets the first request's id."""
        keys = [k for k in dedup_keys if k]
        for key in keys:
            existing = self.store.future_by_dedup(key)
            if existing is not None:
                return existing.request_id, False
        request_id = f"req-{uuid.uuid4().hex}"
        self.store.add(
            FutureRow(
                request_id=request_id, kind=kind, model_id=model_id, dedup_key=keys[0] if keys else None
            )
        )
        self._events[request_id] = asyncio.Event()
        return request_id, True

    async def execute(self, request_id: str, work: Work) -> None:
        """Await `work` and record its result: bytes (protobuf) or a JSON-able dict, or an error."""
        try:
            value = await work()
        except Exception as exc:
            category = error_category(exc)
            if category == "server":
                logger.exception("request %s failed", request_id)
            else:
                logger.info("request %s: user error: %s", request_id, exc)
            self.store.finish_future(request_id, error=error_message(exc), category=category)
        else:
            if isinstance(value, bytes):
                self.store.finish_future(request_id, content_type=PROTOBUF, result=value)
            else:
                self.store.finish_future(request_id, content_type=JSON, result=json.dumps(value).encode())
        event = self._events.pop(request_id, None)
        if event is not None:
            event.set()

    def start(self, request_id: str, work: Work) -> None:
        """Run `work` for `request_id` in the background."""
        task = asyncio.get_running_loop().create_task(self.execute(request_id, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def fail(self, request_id: str, exc: Exception) -> None:
        async def raise_it() -> Any:
            raise exc

        self.start(request_id, raise_it)

    async def wait(self, request_id: str, timeout_s: float) -> FutureRow | None:
        """The finished future, None while it is still running after `timeout_s`; KeyError if unknown."""
        row = self.store.get(FutureRow, request_id)
        if row is None:
            raise KeyError(request_id)
        if row.status != "pending":
            return row
        event = self._events.get(request_id)
        if event is None:  # pending in the store but not in this process: lost in a restart
            return row
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return None
        return self.store.get(FutureRow, request_id)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class OrderedQueue:
    """Runs one model's operations one at a time in ``seq_id`` order.

    An operation whose predecessors have not arrived waits for them at most `gap_timeout_s`
    (the SDK sends the chunks of one batch in parallel, the first one last).
    """

    def __init__(self, name: str, gap_timeout_s: float = 2.0) -> None:
        self.name = name
        self.gap_timeout_s = gap_timeout_s
        self.next_seq = 1
        self._items: dict[int, tuple[float, Work]] = {}
        self._cond = asyncio.Condition()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def put(self, seq_id: int | None, work: Work) -> None:
        async with self._cond:
            seq = 0 if seq_id is None else int(seq_id)
            while seq in self._items:  # a different op reusing a seq id: keep both, in arrival order
                seq += 1
            self._items[seq] = (time.monotonic(), work)
            self._cond.notify_all()

    async def _next(self) -> Work:
        async with self._cond:
            while True:
                if self._items:
                    seq = min(self._items)
                    arrived, work = self._items[seq]
                    remaining = arrived + self.gap_timeout_s - time.monotonic()
                    if seq <= self.next_seq or remaining <= 0:
                        if seq > self.next_seq:
                            logger.warning(
                                "%s: seq_id %d never arrived; running %d", self.name, self.next_seq, seq
                            )
                        del self._items[seq]
                        self.next_seq = max(self.next_seq, seq + 1)
                        return work
                    try:
                        await asyncio.wait_for(self._cond.wait(), remaining)
                    except TimeoutError:
                        pass
                else:
                    await self._cond.wait()

    async def _run(self) -> None:
        while True:
            work = await self._next()
            try:
                await work()
            except Exception:  # work is FutureHub.execute, which records its own errors
                logger.exception("%s: operation failed outside its future", self.name)

    async def close(self) -> None:
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)
