"""One pooled aiohttp session per event loop, shared by every remote engine of a process.

aiohttp sessions are bound to the loop that created them; trainers sometimes run several loops in
turn (e.g. `asyncio.run` per step). `SessionPool.get()` hands out the session of the running
loop and rebuilds it when the loop changed or the session was closed.

Settings come from the environment:
- `SKYLIFT_HTTP_CONNECTION_LIMIT` (default 256): connections per session (all hosts together);
- `SKYLIFT_HTTP_KEEPALIVE_S` (default 4.0): idle keep-alive of pooled connections; it must stay
  below the server's (uvicorn closes idle connections after 5 s), or a request may be written
  into a connection the server is closing.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import aiohttp

DEFAULT_CONNECTION_LIMIT = 256
DEFAULT_KEEPALIVE_S = 4.0

N = TypeVar("N", int, float)


def _env_positive(name: str, default: N, parse: Callable[[str], N]) -> N:
    """The variable `name` parsed by `parse` (int or float), `default` when unset; it must be > 0."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse(raw)
    except ValueError as e:
        raise ValueError(f"{name} must be {'an integer' if parse is int else 'a number'}, got {raw!r}") from e
    if value <= 0:
        raise ValueError(f"{name} must be {'>= 1' if parse is int else '> 0'}, got {value}")
    return value


def connection_limit() -> int:
    """The connection limit per session (`SKYLIFT_HTTP_CONNECTION_LIMIT`, default 256)."""
    return _env_positive("SKYLIFT_HTTP_CONNECTION_LIMIT", DEFAULT_CONNECTION_LIMIT, int)


def keepalive_s() -> float:
    """Idle keep-alive of pooled connections (`SKYLIFT_HTTP_KEEPALIVE_S`, default 4 s)."""
    return _env_positive("SKYLIFT_HTTP_KEEPALIVE_S", DEFAULT_KEEPALIVE_S, float)


class SessionPool:
    """Hands out one `aiohttp.ClientSession` per running event loop."""

    def __init__(self, limit: int | None = None, keepalive: float | None = None) -> None:
        self.limit = limit if limit is not None else connection_limit()
        self.keepalive = keepalive if keepalive is not None else keepalive_s()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._session: aiohttp.ClientSession | None = None
        self._lock = threading.Lock()

    def get(self) -> aiohttp.ClientSession:
        """The session of the running loop (created on first use or after a loop change)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            session = self._session
            if session is None or session.closed or self._loop is not loop:
                # A session of a previous (usually closed) loop cannot be closed from here;
                # its connections die with that loop. Detach it so it is not reused.
                if session is not None and not session.closed and self._loop is not None:
                    _detach(session)
                connector = aiohttp.TCPConnector(
                    limit=self.limit,
                    limit_per_host=0,
                    keepalive_timeout=self.keepalive,
                )
                session = aiohttp.ClientSession(connector=connector, trust_env=False)
                self._session = session
                self._loop = loop
            return session

    async def close(self) -> None:
        """Close the session if it belongs to the running loop; forget it otherwise."""
        with self._lock:
            session, loop = self._session, self._loop
            self._session, self._loop = None, None
        if session is None or session.closed:
            return
        if loop is asyncio.get_running_loop():
            await session.close()
        else:
            _detach(session)


def _detach(session: aiohttp.ClientSession) -> None:
    """Stop aiohttp from warning about a session whose loop is gone (nothing to await there)."""
    try:
        connector = session.connector
        if connector is not None:
            connector._close()  # noqa: SLF001 - synchronous close of the sockets
        session._connector = None  # noqa: SLF001
    except Exception:  # pragma: no cover - best effort on a dead loop
        pass


_default_pool: SessionPool | None = None
_default_lock = threading.Lock()


def default_pool() -> SessionPool:
    """The process-wide pool (settings read from the environment on first use)."""
    global _default_pool
    with _default_lock:
        if _default_pool is None:
            _default_pool = SessionPool()
        return _default_pool


async def close_default_pool() -> None:
    """Close the process-wide session (call once at shutdown, from the loop that used it)."""
    with _default_lock:
        pool = _default_pool
    if pool is not None:
        await pool.close()


def error_text(payload: Any, text: str) -> str:
    """The message of an error answer: OpenAI-style `{"error": {"message": ...}}`, FastAPI's
    `{"detail": ...}`, else the start of the raw body."""
    if isinstance(payload, dict):
        err = payload.get("error", payload.get("detail"))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if err is not None:
            return str(err)
    return text[:2000] or "(empty body)"
