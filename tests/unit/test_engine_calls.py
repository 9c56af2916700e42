"""The engine boundary's shared pieces: one deadline wrapper, one fan-out, one finish-reason
mapping and the server's error statuses (no vLLM or Ray started; the Ray proxy:
test_ray_engine_proxy.py)."""

from __future__ import annotations

import asyncio

import pytest

from skylift.inference.types import (
    EngineCapabilityError,
    EngineError,
    EngineRequestError,
    EngineStateError,
    EngineUnavailableError,
)
from skylift.utils.calls import call_with_timeout, gather_all


def test_a_timeout_names_who_and_what() -> None:
    async def never() -> None:
        await asyncio.sleep(60)

    with pytest.raises(EngineUnavailableError, match=r"^engine-3: generate gave no answer within 0 s$"):
        asyncio.run(
            call_with_timeout("engine-3", "generate", never(), 0.05, timeout_error=EngineUnavailableError)
        )


def test_failures_are_wrapped_kept_or_chosen() -> None:
    async def fail(exc: Exception) -> None:
        raise exc

    async def run(exc: Exception, **kw: object) -> None:
        await call_with_timeout("server", "sleep", fail(exc), 5.0, **kw)  # type: ignore[arg-type]

    with pytest.raises(EngineError, match="^server: sleep failed: boom$") as info:
        asyncio.run(run(OSError("boom"), error=EngineError))
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(EngineStateError, match="^no group$"):  # a kept type passes unchanged
        asyncio.run(run(EngineStateError("no group"), error=EngineError, keep=(EngineError,)))
    with pytest.raises(KeyError):  # no error choice: the cause itself
        asyncio.run(run(KeyError("k")))

    def choose(message: str, exc: Exception) -> Exception | None:
        return EngineUnavailableError(f"{message}: it died") if isinstance(exc, ConnectionError) else None

    with pytest.raises(EngineUnavailableError, match="^server: sleep failed: it died$"):
        asyncio.run(run(ConnectionResetError(), error=choose))
    with pytest.raises(ValueError, match="bad"):
        asyncio.run(run(ValueError("bad"), error=choose))


def test_gather_all_returns_failures_in_order_or_fails_fast() -> None:
    cancelled: list[bool] = []

    async def ok(v: int) -> int:
        return v

    async def bad() -> int:
        raise RuntimeError("down")

    async def slow() -> int:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 0

    results = asyncio.run(gather_all([ok(1), bad(), ok(3)]))
    assert results[0] == 1 and results[2] == 3 and isinstance(results[1], RuntimeError)
    with pytest.raises(RuntimeError, match="down"):
        asyncio.run(gather_all([slow(), bad()], fail_fast=True))
    assert cancelled == [True]  # the rest was cancelled, not left running


def test_one_finish_reason_mapping() -> None:
    from skylift.inference.vllm_io import stop_reason

    assert [stop_reason(r) for r in ("stop", "length", "abort")] == ["stop", "length", "abort"]
    assert stop_reason("error") == "abort"
    assert stop_reason(None) == "abort"


def test_engine_errors_map_to_http_statuses() -> None:
    from skylift.inference.routes import status_of

    assert status_of(EngineRequestError("x")) == 400
    assert status_of(EngineStateError("x")) == 409
    assert status_of(EngineCapabilityError("x")) == 501
    assert status_of(EngineUnavailableError("x")) == 503
    assert status_of(EngineError("x")) == 500
    assert isinstance(EngineRequestError("x"), ValueError)


def test_an_engine_call_answers_or_raises_its_http_status(caplog: pytest.LogCaptureFixture) -> None:
    from fastapi import HTTPException

    from skylift.inference.engine_http import engine_call
    from skylift.inference.types import EngineNotFoundError

    async def answer() -> int:
        return 7

    async def fail(exc: EngineError) -> None:
        raise exc

    assert asyncio.run(engine_call(answer())) == 7
    with pytest.raises(HTTPException) as not_found:
        asyncio.run(engine_call(fail(EngineNotFoundError("no adapter 'a'"))))
    assert (not_found.value.status_code, not_found.value.detail) == (404, "no adapter 'a'")
    assert not caplog.records  # a client's mistake is not logged
    with pytest.raises(HTTPException) as broken:
        asyncio.run(engine_call(fail(EngineError("engine died"))))
    assert broken.value.status_code == 500
    assert [r.getMessage() for r in caplog.records] == ["engine died"]
