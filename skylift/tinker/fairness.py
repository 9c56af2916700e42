"""Fair shares of what all users of one Tinker server have in common.

`FairGate` hands out a fixed number of slots (the single training thread: one; a sampling
engine: a few concurrent requests) round robin across the users waiting for one: a user with
a thousand requests queued gets the next slot only after every other waiting user got one, so
one user's flood delays another user's request by at most one request of each other user. A
request that waits longer than the gate's `wait_timeout_s` fails with `BusyError` (HTTP 429 on a
direct route, a failed future of category "user" on an operation route) naming the wait and the
setting that changes it.

`QuotaError` is the error of a per-user quota (outstanding futures, snapshots, disk): also a 429,
since the user can retry once its earlier work finished or was deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict, deque
from collections.abc import AsyncIterator

from skylift.tinker.errors import UserError


class QuotaError(UserError):
    """A per-user quota is used up (HTTP 429)."""


class BusyError(QuotaError):
    """A request waited too long for its fair share of a shared resource (HTTP 429)."""


class FairGate:
    """`slots` holders at a time; waiting users served round robin, each user's own requests in
    the order they came; `wait_timeout_s` (None: no limit) bounds one request's wait."""

    def __init__(self, slots: int, wait_timeout_s: float | None, what: str, setting: str) -> None:
        if slots < 1:
            raise ValueError(f"{what}: slots must be >= 1, got {slots}")
        self.slots, self.wait_timeout_s = slots, wait_timeout_s
        self.what, self.setting = what, setting
        self._busy = 0
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()  # in turn order
        self.granted: list[str] = []  # users in the order they got a slot (the last 1000)

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def waiting_of(self, user: str) -> int:
        return len(self._waiting.get(user, ()))

    @contextlib.asynccontextmanager
    async def slot(self, user: str | None) -> AsyncIterator[None]:
        """Hold one slot for `user` while the block runs."""
        await self._acquire(user or "")
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, user: str) -> None:
        if self._busy < self.slots and not self._waiting:
            self._grant(user)
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(user, deque()).append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter), self.wait_timeout_s)
        except TimeoutError:
            if waiter.done():  # granted just as the wait ended: keep it
                return
            self._forget(user, waiter)
            raise BusyError(
                f"{self.what}: waited {self.wait_timeout_s:g} s for a turn behind other users' requests "
                f"({self.waiting} waiting); retry later, or the operator raises {self.setting}"
            ) from None
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._release()  # granted, but its holder is gone
            else:
                self._forget(user, waiter)
            raise

    def _grant(self, user: str) -> None:
        self._busy += 1
        self.granted.append(user)
        del self.granted[:-1000]

    def _forget(self, user: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(user)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[user]
        waiter.cancel()

    def _release(self) -> None:
        self._busy -= 1
        while self._busy < self.slots and self._waiting:
            user, queue = next(iter(self._waiting.items()))
            waiter = queue.popleft()
            del self._waiting[user]
            if queue:  # the user's next request waits behind every other waiting user
                self._waiting[user] = queue
            self._grant(user)
            waiter.set_result(None)
