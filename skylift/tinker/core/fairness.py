"""Fair shares of what all users of one Tinker server have in common.

`FairGate` hands out a fixed number of slots (the single training thread: one; a sampling
engine: a few concurrent requests) round robin across the users waiting for one: a user with
a thousand requests queued gets the next slot only after every other waiting user got one, so
one user's flood delays another user's request by at most one request of each other user. With
`per_user` below `slots` (a sampling engine: one slot less than it has) no user holds every slot,
so another user's request starts at once instead of waiting for one to end. A
request that waits longer than the gate's `wait_timeout_s` fails with `BusyError` (HTTP 429 on a
direct route, a failed future of category "user" on an operation route) naming the wait and the
setting that changes it.

`QuotaError` is the error of a per-user quota (outstanding futures, snapshots, disk): also a 429,
since the user can retry once its earlier work finished or was deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncIterator

from skylift.tinker.errors import UserError


class QuotaError(UserError):
    """A per-user quota is used up (HTTP 429)."""


class BusyError(QuotaError):
    """A request waited too long for its fair share of a shared resource (HTTP 429)."""


class FairGate:
    """`slots` holders at a time, at most `per_user` of them one user's (None: `slots`); waiting
    users served round robin, each user's own requests in the order they came; `wait_timeout_s`
    (None: no limit) bounds one request's wait."""

    def __init__(
        self,
        slots: int,
        wait_timeout_s: float | None,
        what: str,
        setting: str,
        per_user: int | None = None,
    ) -> None:
        if slots < 1:
            raise ValueError(f"{what}: slots must be >= 1, got {slots}")
        self.slots, self.wait_timeout_s = slots, wait_timeout_s
        self.per_user = slots if per_user is None else max(1, min(per_user, slots))
        self.what, self.setting = what, setting
        self._busy = 0
        self._held: Counter[str] = Counter()  # slots each user holds
        self._waiting: OrderedDict[str, deque[asyncio.Future[None]]] = OrderedDict()  # in turn order
        self.granted: list[str] = []  # users in the order they got a slot (the last 1000)

    @property
    def busy(self) -> int:
        """Slots held now."""
        return self._busy

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiting.values())

    def waiting_of(self, user: str) -> int:
        return len(self._waiting.get(user, ()))

    @contextlib.asynccontextmanager
    async def slot(self, user: str | None) -> AsyncIterator[None]:
        """Hold one slot for `user` while the block runs."""
        user = user or ""
        await self._acquire(user)
        try:
            yield
        finally:
            self._release(user)

    async def _acquire(self, user: str) -> None:
        if self._busy < self.slots and self._held[user] < self.per_user and self._next_user() is None:
            self._grant(user)  # a free slot, and no one waiting who may take it
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
                self._release(user)  # granted, but its holder is gone
            else:
                self._forget(user, waiter)
            raise

    def _grant(self, user: str) -> None:
        self._busy += 1
        self._held[user] += 1
        self.granted.append(user)
        del self.granted[:-1000]

    def _forget(self, user: str, waiter: asyncio.Future[None]) -> None:
        queue = self._waiting.get(user)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[user]
        waiter.cancel()

    def _next_user(self) -> str | None:
        """The first waiting user, in turn order, still under its share of the slots."""
        return next((u for u in self._waiting if self._held[u] < self.per_user), None)

    def _release(self, user: str) -> None:
        self._busy -= 1
        self._held[user] -= 1
        if not self._held[user]:
            del self._held[user]
        while self._busy < self.slots:
            user = self._next_user()
            if user is None:
                return
            queue = self._waiting.pop(user)
            waiter = queue.popleft()
            if queue:  # the user's next request waits behind every other waiting user
                self._waiting[user] = queue
            self._grant(user)
            waiter.set_result(None)
