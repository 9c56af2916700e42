"""Which server serves a request: sticky by session id, least-loaded otherwise.

`LoadRouter` is pure bookkeeping (no I/O): it counts the work in flight on each server and
remembers which server a multi-turn session started on, so that its later turns reuse that
server's prefix cache.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence


class NoServerLeftError(RuntimeError):
    """Every server of the router has been disabled."""


class LoadRouter:
    """Picks servers by in-flight load, keeping sessions sticky.

    Load is counted in units chosen by the caller (e.g. sequences = prompts x n). Ties go to the
    lowest index after a round-robin offset, so an idle pool still spreads single requests.
    """

    def __init__(self, num_servers: int, max_sessions: int = 100_000) -> None:
        if num_servers < 1:
            raise ValueError(f"LoadRouter needs at least one server, got {num_servers}")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.num_servers = num_servers
        self.max_sessions = max_sessions
        self._in_flight = [0] * num_servers
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._next_tie = 0
        self._disabled: set[int] = set()
        self._lock = threading.Lock()

    @property
    def in_flight(self) -> list[int]:
        """A copy of the current load of every server."""
        with self._lock:
            return list(self._in_flight)

    def _least_loaded(self, pending: Sequence[int] | None = None) -> int:
        loads = (
            self._in_flight
            if pending is None
            else [a + b for a, b in zip(self._in_flight, pending, strict=True)]
        )
        start = self._next_tie
        self._next_tie = (self._next_tie + 1) % self.num_servers
        order = [(start + k) % self.num_servers for k in range(self.num_servers)]
        usable = [i for i in order if i not in self._disabled]
        if not usable:
            raise NoServerLeftError(f"all {self.num_servers} servers are disabled")
        return min(usable, key=lambda i: loads[i])

    def pick(self, session_id: str | None = None) -> int:
        """The server for one request: the session's server if known, else the least loaded."""
        with self._lock:
            known = self._sessions.get(session_id) if session_id is not None else None
            if known is not None and known not in self._disabled:
                self._sessions.move_to_end(session_id)  # type: ignore[arg-type]
                return known
            index = self._least_loaded()
            if session_id is not None:
                self._remember(session_id, index)
            return index

    def assign(self, weights: Sequence[int]) -> list[int]:
        """Spread a batch of items (each with a load weight) over servers, greedily balancing load.

        Returns the server index of each item. Nothing is acquired; call `acquire` per server.
        """
        with self._lock:
            pending = [0] * self.num_servers
            out: list[int] = []
            for weight in weights:
                if weight < 0:
                    raise ValueError(f"load weights must be >= 0, got {weight}")
                index = self._least_loaded(pending)
                pending[index] += weight
                out.append(index)
            return out

    def acquire(self, index: int, weight: int = 1) -> None:
        """Count `weight` units of work as started on server `index`."""
        self._check_index(index)
        with self._lock:
            self._in_flight[index] += weight

    def release(self, index: int, weight: int = 1) -> None:
        """Count `weight` units of work as finished on server `index`."""
        self._check_index(index)
        with self._lock:
            self._in_flight[index] = max(0, self._in_flight[index] - weight)

    def disable(self, index: int) -> None:
        """Stop routing to server `index` (it failed); its sessions move on their next request."""
        self._check_index(index)
        with self._lock:
            self._disabled.add(index)

    @property
    def enabled(self) -> list[int]:
        """Indices of the servers still routed to."""
        with self._lock:
            return [i for i in range(self.num_servers) if i not in self._disabled]

    def forget(self, session_id: str) -> None:
        """Drop a session's stickiness (e.g. when the conversation ended)."""
        with self._lock:
            self._sessions.pop(session_id, None)

    def session_server(self, session_id: str) -> int | None:
        """The server a session is pinned to, if any."""
        with self._lock:
            return self._sessions.get(session_id)

    def _remember(self, session_id: str, index: int) -> None:
        self._sessions[session_id] = index
        self._sessions.move_to_end(session_id)
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def _check_index(self, index: int) -> None:
        if not 0 <= index < self.num_servers:
            raise IndexError(f"server index {index} out of range 0..{self.num_servers - 1}")
