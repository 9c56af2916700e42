"""The run's one event loop on its own thread (`skylift.utils.loop_thread.LoopThread`)."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from skylift.utils.loop_thread import LoopThread


def test_any_thread_runs_work_on_the_loop_while_other_work_is_in_flight() -> None:
    loop = LoopThread(name="run-loop")
    try:
        gate = asyncio.Event()

        async def slow() -> str:
            await gate.wait()
            return "slow"

        pending = loop.submit(slow())
        assert loop.run(asyncio.sleep(0, result="fast")) == "fast"  # not behind the slow one
        assert not pending.done()
        answers: list[str] = []
        worker = threading.Thread(target=lambda: answers.append(loop.run(asyncio.sleep(0, result="other"))))
        worker.start()
        worker.join(5)
        assert answers == ["other"] and not pending.done()
        loop.loop.call_soon_threadsafe(gate.set)
        assert pending.result(5) == "slow"
    finally:
        loop.stop()


def test_run_on_the_loops_own_thread_is_refused_not_a_deadlock() -> None:
    loop = LoopThread()

    async def nested() -> str:
        try:
            loop.run(asyncio.sleep(0))
        except RuntimeError as exc:
            return str(exc)
        return "ran"

    try:
        assert "own thread" in loop.run(nested(), timeout_s=5)
    finally:
        loop.stop()


def test_stop_cancels_what_still_runs_and_refuses_new_work() -> None:
    loop = LoopThread()
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    loop.submit(forever())
    time.sleep(0.05)
    loop.stop(timeout_s=5)
    assert cancelled.is_set() and loop.closed and loop.loop.is_closed()
    loop.stop()  # idempotent
    with pytest.raises(RuntimeError, match="was stopped"):
        loop.submit(asyncio.sleep(0))


def test_a_timed_out_run_cancels_its_coroutine() -> None:
    loop = LoopThread()
    try:
        with pytest.raises(TimeoutError):
            loop.run(asyncio.sleep(5), timeout_s=0.1)
        assert loop.run(asyncio.sleep(0, result=1)) == 1  # the loop serves on
    finally:
        loop.stop()
