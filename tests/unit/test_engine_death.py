"""An engine death ends the calls waiting on it at once (issue 42, item 6), not at their timeout.

vLLM flags a dead engine core at once (its monitor thread sets `engine_dead`, so `AsyncLLM.errored`
holds) but fails only the requests its output handler had registered, once it closed its sockets,
and never answers utility calls in flight. `DyingCore` is an `AsyncLLM` in that state: `errored`
turns True while every call waits. The engine death with a real vLLM engine core killed:
tests/reliability/test_engine_failover.py."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from skylift.inference.local import LocalVLLMEngine
from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.inference.types import EngineUnavailableError, SamplingParams
from skylift.utils.watchdog import unless_failed

#: far below the calls' 300 s timeouts (so the death ended them), far above the 0.2 s poll (a
#: loaded machine's scheduling): how long a call may take to end once its engine is dead
ENDED_BY_DEATH_S = 30.0


class DyingCore:
    """The part of vLLM's `AsyncLLM` the engine calls, for a core that dies (`die()`) while
    nothing it was asked ever answers."""

    def __init__(self) -> None:
        self.errored = False
        self.started: list[str] = []
        self.aborted: list[str] = []

    def die(self) -> None:
        self.errored = True

    async def generate(self, prompt: Any, params: Any, request_id: str, **kwargs: Any) -> Any:
        self.started.append(request_id)
        await asyncio.Event().wait()  # no output ever comes
        yield None

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def pause_generation(self, mode: str) -> None:
        await asyncio.Event().wait()

    async def collective_rpc(self, method: str, timeout: float, args: tuple) -> list[Any]:
        await asyncio.Event().wait()
        return []


def _engine(core: DyingCore) -> LocalVLLMEngine:
    return LocalVLLMEngine(
        core,
        name="engine-doomed",
        tensor_parallel_size=1,
        sleep_mode_enabled=False,
        generate_timeout_s=300.0,
        control_timeout_s=300.0,
        update_timeout_s=300.0,
    )


async def _ended_after_death(core: DyingCore, call: Any, expect: type[Exception]) -> tuple[float, str]:
    """Seconds from the core's death to the end of `call` (started 0.3 s before), and its error."""
    task = asyncio.ensure_future(call)
    await asyncio.sleep(0.3)
    assert not task.done()
    core.die()
    died = time.monotonic()
    with pytest.raises(expect) as info:
        await asyncio.wait_for(task, 10.0)
    return time.monotonic() - died, str(info.value)


def test_a_generate_waiting_on_a_dead_core_ends_within_the_poll_naming_the_engine() -> None:
    core = DyingCore()
    pool = EnginePool([_engine(core)])
    params = SamplingParams(max_tokens=8, n=2)
    waited, message = asyncio.run(
        _ended_after_death(core, pool.generate([[1, 2], [3]], params), NoHealthyEngineError)
    )
    assert waited < ENDED_BY_DEATH_S, waited
    assert "engine-doomed" in message and "generate failed: the vLLM engine process died" in message
    assert len(core.started) == 2 and sorted(core.aborted) == sorted(core.started)  # each request aborted


def test_a_control_or_weight_call_waiting_on_a_dead_core_ends_too() -> None:
    for call in ("pause", "rpc"):
        core = DyingCore()
        engine = _engine(core)
        awaitable = (
            engine.pause_generation("keep")
            if call == "pause"
            else engine.rpc("has_weight_update_group", "has_group", (), 300.0)
        )
        waited, message = asyncio.run(_ended_after_death(core, awaitable, EngineUnavailableError))
        assert waited < ENDED_BY_DEATH_S, (call, waited)
        assert message.startswith("engine-doomed: ") and "the vLLM engine process died" in message


def test_unless_failed_passes_results_and_errors_and_cancels_on_failure_or_cancellation() -> None:
    async def value() -> int:
        await asyncio.sleep(0.01)
        return 7

    async def fails() -> None:
        raise KeyError("k")

    cancelled: list[str] = []

    async def waits(name: str) -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.append(name)
            raise

    async def scenario() -> None:
        assert await unless_failed(value(), lambda: None, 0.001) == 7
        with pytest.raises(KeyError):
            await unless_failed(fails(), lambda: None, 0.001)
        polls: list[float] = []

        def gone_on_third_poll() -> BaseException | None:
            polls.append(time.monotonic())
            return ConnectionError("gone") if len(polls) == 3 else None

        with pytest.raises(ConnectionError, match="gone"):
            await unless_failed(waits("failed"), gone_on_third_poll, 0.01)
        outer = asyncio.ensure_future(unless_failed(waits("outer"), lambda: None, 0.01))
        await asyncio.sleep(0.05)
        outer.cancel()
        with pytest.raises(asyncio.CancelledError):
            await outer

    asyncio.run(scenario())
    assert cancelled == ["failed", "outer"]


def test_vllms_log_of_a_dead_core_is_one_line(caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's output handler logs the core's death with a traceback of its own wait: with the
    `quiet_dead_core` patch installed (as every in-process engine's start does) that record is one
    line; any other error it logs keeps its traceback."""
    import logging

    from vllm.v1.engine.exceptions import EngineDeadError

    from skylift.inference.vllm_patches import quiet_dead_core

    quiet_dead_core.install()
    quiet_dead_core.install()  # idempotent: one filter
    log = logging.getLogger(quiet_dead_core.LOGGER)
    assert log.filters.count(quiet_dead_core.FILTER) == 1
    for exc in (EngineDeadError(), ValueError("a bug in a step")):
        try:
            raise exc
        except Exception:
            with caplog.at_level(logging.ERROR, logger=quiet_dead_core.LOGGER):
                log.exception("AsyncLLM output_handler failed.")
    dead, other = caplog.records
    assert dead.exc_info is None and dead.getMessage() == (
        "AsyncLLM output_handler failed. The engine core process died (EngineDeadError)"
    )
    assert caplog.text.count("Traceback") == 1  # the other error's
    assert other.exc_info is not None and isinstance(other.exc_info[1], ValueError)
