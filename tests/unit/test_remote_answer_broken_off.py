"""A `skylift serve` killed while it sends an answer: the client's request fails as the engine's
unavailability (`RemoteEngineUnavailableError`), which the pool and the training loop handle (the
engine taken out, the run stopped in one line), not as aiohttp's `ClientPayloadError` (a
traceback, exit 1: found by a whole Ray run whose engine was killed under the suite's load)."""

from __future__ import annotations

import asyncio

import pytest

from skylift.inference.remote import RemoteEngineUnavailableError, RemoteInferenceEngine
from skylift.utils.engine_errors import EngineUnavailableError


async def _serve_half_answers() -> tuple[asyncio.AbstractServer, int, list[int]]:
    """A server on loopback that answers each request with its headers and part of its body, then
    closes the connection (what a server killed mid-answer leaves its client)."""
    answered: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        answered.append(1)
        writer.write(
            b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2699\r\n\r\n{"out'
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1], answered


def test_an_answer_that_breaks_off_is_the_engine_unavailable_and_retried() -> None:
    async def run() -> tuple[BaseException, int]:
        server, port, answered = await _serve_half_answers()
        engine = RemoteInferenceEngine(f"127.0.0.1:{port}", max_retries=2, backoff_s=0.01, max_backoff_s=0.02)
        try:
            with pytest.raises(RemoteEngineUnavailableError) as caught:
                await engine.request("POST", "/skylift/generate", "generate", json={}, retry=True)
            return caught.value, len(answered)
        finally:
            await engine.close()
            server.close()
            await server.wait_closed()

    error, attempts = asyncio.run(run())
    assert isinstance(error, EngineUnavailableError)
    assert str(error).startswith("generate on http://127.0.0.1:")
    assert "the answer broke off: ClientPayloadError" in str(error)
    assert attempts == 3  # retried as a dropped connection is
