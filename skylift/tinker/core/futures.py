"""Futures: every operation POST returns a request id at once; the result is polled later.

`FutureHub` records each future in the store (so results survive a restart), de-duplicates
repeated POSTs by key (a model's ``seq_id``, a sampler's ``seq_id`` or the client's
``X-Idempotency-Key``, scoped to the calling user), runs the work and long-polls for results.
`OrderedQueue` executes one training model's operations in ``seq_id`` order, one at a time.

The hub never blocks the event loop on the database: writes (new futures, results) go to one
writer thread in order, reads run in worker threads; a future's live state (owner, pending or
final) is kept in memory until its result is written. A future is one of

- pending: running or queued (in this process);
- done / failed: final; retrieving it starts its retention clock (`retention_s`), after which
  the row and its result are deleted; one never retrieved is deleted `max_age_s` after it
  finished (``--future-max-age-s``);
- lost: pending when a previous server process stopped; `retrieve_future` answers HTTP 410, on
  which the SDK resubmits the original request (sampling does so on its own);
- abandoned: a queued or running operation of a model that was released (its session
  finished) fails at once with a user error naming the reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import functools
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from skylift.tinker.core.auth import current_user
from skylift.tinker.core.fairness import QuotaError
from skylift.tinker.errors import error_category, error_message
from skylift.tinker.storage.store import FutureRow, Store, utcnow

logger = logging.getLogger(__name__)

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
#: Dedup keys are remembered at least this long (the SDK repeats a POST within minutes).
DEDUP_MEMORY_S = 600.0

Work = Callable[[], Awaitable[Any]]


@dataclass
class Outcome:
    """What `retrieve_future` answers for one future."""

    status: str  # pending | done | failed | lost
    content_type: str | None = None
    result: bytes | None = None
    error: str | None = None
    category: str | None = None


@dataclass
class _Live:
    """A future of this process: pending, or final but not yet written to the database."""

    owner: str | None
    model_id: str | None
    event: asyncio.Event
    final: Outcome | None = None
    written: bool = False
    started: bool = False
    abandoned: str | None = None


class FutureHub:
    """Creates, resolves and waits for futures (see the module docstring for their states)."""

    def __init__(
        self,
        store: Store,
        retention_s: float | None = None,
        max_age_s: float | None = None,
        max_pending_per_user: int | None = None,
    ) -> None:
        self.store = store
        self.retention_s = retention_s
        self.max_age_s = max_age_s
        self.max_pending_per_user = max_pending_per_user
        self._pending: dict[str | None, int] = {}  # owner -> futures not final yet
        self._live: dict[str, _Live] = {}
        self._adding: dict[str, asyncio.Future[Any]] = {}  # records being written
        self._keys: OrderedDict[str, tuple[str, float]] = OrderedDict()  # dedup key -> (id, time)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-db-writer")
        self._prune_task: asyncio.Task[None] | None = None
        if retention_s is not None or max_age_s is not None:
            self._prune_task = asyncio.get_running_loop().create_task(self._prune_loop())

    # ---------------------------------------------------------------- database, off the loop
    def _write(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """Run a store write on the writer thread (in submission order)."""
        return asyncio.get_running_loop().run_in_executor(self._writer, fn, *args)

    async def _read(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    # ---------------------------------------------------------------- creating
    def submit(
        self, kind: str, model_id: str | None, dedup_keys: Sequence[str | None] = ()
    ) -> tuple[str, bool]:
        """(request id, True if new). A repeated POST (same key, same user) gets the first id."""
        owner = current_user.get()
        keys = [f"{owner or ''}|{k}" for k in dedup_keys if k]
        self._forget_old_keys()
        for key in keys:
            known = self._keys.get(key)
            if known is not None:
                return known[0], False
        pending = self._pending.get(owner, 0)
        if self.max_pending_per_user is not None and pending >= self.max_pending_per_user:
            raise QuotaError(
                f"{kind}: you have {pending} requests pending, this server's limit per user "
                f"(--max-pending-per-user); retrieve their results, or wait for them, before sending more"
            )
        self._pending[owner] = pending + 1
        request_id = f"req-{uuid.uuid4().hex}"
        now = time.monotonic()
        for key in keys:
            self._keys[key] = (request_id, now)
        self._live[request_id] = _Live(owner=owner, model_id=model_id, event=asyncio.Event())
        row = FutureRow(request_id=request_id, kind=kind, model_id=model_id, owner=owner)
        written = self._write(self.store.add, row)
        written.add_done_callback(self._log_write_error)
        self._adding[request_id] = written
        written.add_done_callback(lambda _, rid=request_id: self._adding.pop(rid, None))
        return request_id, True

    async def persisted(self, request_id: str) -> None:
        """Wait until `request_id`'s record is written, so that a reply naming it survives a crash
        right after (a failed write is logged by its callback)."""
        written = self._adding.get(request_id)
        if written is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(written)

    def _forget_old_keys(self) -> None:
        horizon = time.monotonic() - max(DEDUP_MEMORY_S, self.retention_s or 0.0)
        while self._keys:
            key, (_, at) = next(iter(self._keys.items()))
            if at >= horizon:
                break
            self._keys.popitem(last=False)

    @staticmethod
    def _log_write_error(done: asyncio.Future[Any]) -> None:
        if not done.cancelled() and done.exception() is not None:
            logger.error("recording a future failed: %s", done.exception())

    # ---------------------------------------------------------------- resolving
    async def _finish(self, request_id: str, outcome: Outcome) -> None:
        live = self._live.get(request_id)
        if live is None or live.final is not None:
            return
        live.final = outcome
        left = self._pending.get(live.owner, 1) - 1
        if left > 0:
            self._pending[live.owner] = left
        else:
            self._pending.pop(live.owner, None)
        try:
            await self._write(
                functools.partial(
                    self.store.finish_future,
                    request_id,
                    content_type=outcome.content_type,
                    result=outcome.result,
                    error=outcome.error,
                    category=outcome.category,
                )
            )
            live.written = True
        except Exception as exc:  # the result stays in memory and is answered from there
            logger.error("writing the result of %s failed: %s", request_id, exc)
        live.event.set()
        if live.written:
            self._live.pop(request_id, None)

    async def execute(self, request_id: str, work: Work) -> None:
        """Await `work` and record its result: bytes (protobuf) or a JSON-able dict, or an error."""
        live = self._live.get(request_id)
        if live is not None:
            if live.final is not None:
                return  # abandoned before it ran
            live.started = True
        try:
            value = await work()
        except asyncio.CancelledError:
            if live is not None and live.abandoned is not None:
                outcome = Outcome("failed", error=live.abandoned, category="user")
                await asyncio.shield(self._finish(request_id, outcome))
            raise  # shutdown: the future stays pending and is reported lost after the restart
        except Exception as exc:
            category = error_category(exc)
            if category == "server":
                logger.exception("request %s failed", request_id)
            else:
                logger.info("request %s: user error: %s", request_id, exc)
            outcome = Outcome("failed", error=error_message(exc), category=category)
        else:
            if isinstance(value, bytes):
                outcome = Outcome("done", content_type=PROTOBUF, result=value)
            else:
                outcome = Outcome("done", content_type=JSON, result=json.dumps(value).encode())
        await asyncio.shield(self._finish(request_id, outcome))

    def start(self, request_id: str, work: Work) -> None:
        """Run `work` for `request_id` in the background."""
        task = asyncio.get_running_loop().create_task(self.execute(request_id, work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def fail(self, request_id: str, exc: Exception) -> None:
        async def raise_it() -> Any:
            raise exc

        self.start(request_id, raise_it)

    def abandon_model(self, model_id: str, reason: str) -> int:
        """Fail the pending futures of `model_id` with the user error `reason`: queued ones at once
        (their queue is being closed, they never run); a running one fails with it when its
        queue's cancellation reaches it, or with its own error if it raises first."""
        count = 0
        for request_id, live in list(self._live.items()):
            if live.model_id == model_id and live.final is None and live.abandoned is None:
                live.abandoned = reason
                count += 1
                if live.started:
                    continue
                task = asyncio.get_running_loop().create_task(
                    self._finish(request_id, Outcome("failed", error=reason, category="user"))
                )
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        return count

    # ---------------------------------------------------------------- retrieving
    async def wait(self, request_id: str, timeout_s: float, user: str | None = None) -> Outcome | None:
        """The future's outcome (status "lost" for one lost in a restart), None while it still runs
        after `timeout_s`; KeyError if unknown or, with `user`, another user's (one database read
        at most)."""
        live = self._live.get(request_id)
        if live is not None:
            if user is not None and live.owner != user:
                raise KeyError(request_id)
            if live.final is None:
                try:
                    await asyncio.wait_for(live.event.wait(), timeout_s)
                except TimeoutError:
                    return None
            if live.final is not None and not live.written:
                return live.final
        row = await self._read(self.store.get, FutureRow, request_id)
        if row is None or (user is not None and row.owner != user):
            raise KeyError(request_id)
        if row.status == "pending":  # pending in the store but not in this process
            return Outcome("lost")
        outcome = Outcome(row.status, row.content_type, row.result, row.error, row.category)
        if row.status in ("done", "failed") and row.retrieved_at is None:
            self._write(self.store.mark_retrieved, request_id).add_done_callback(self._log_write_error)
        return outcome

    async def _prune_loop(self) -> None:
        ages = [a for a in (self.retention_s, self.max_age_s) if a is not None]
        interval = max(0.5, min(min(ages) / 4, 60.0))
        while True:
            await asyncio.sleep(interval)
            try:
                await self.prune()
            except Exception:
                logger.exception("pruning futures failed")

    async def prune(self) -> int:
        """Delete futures retrieved more than `retention_s` ago and final futures never retrieved
        that finished more than `max_age_s` ago (an abandoned client's results)."""
        pruned = 0
        if self.retention_s is not None:
            cutoff = utcnow() - dt.timedelta(seconds=self.retention_s)
            pruned += await self._write(self.store.prune_retrieved, cutoff)
        if self.max_age_s is not None:
            cutoff = utcnow() - dt.timedelta(seconds=self.max_age_s)
            pruned += await self._write(self.store.prune_unretrieved, cutoff)
        if pruned:
            logger.info("pruned %d futures", pruned)
        return pruned

    async def close(self) -> None:
        if self._prune_task is not None:
            self._prune_task.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._writer.shutdown(wait=True)


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
