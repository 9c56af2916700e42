"""One-step-off asynchronous training: generation of step t+1 overlaps training of step t.

Design (the simplest one without races on the engines' weights):

1. Step t takes its rollouts from the generation launched during step t-1 (step 1 generates first).
2. It launches the generation of step t+1 in the background, sampled with the weights the engines
   hold now (their policy version is recorded in every `Trajectory.policy_version`).
3. It trains on step t's rollouts while the engines generate; the policy version goes up by one.
4. It waits for the background generation to finish, and only then broadcasts the new weights:
   no generation is ever in flight during a weight sync, so no request sees half-updated weights.
5. Evaluation and checkpoints follow, with the engines idle and up to date.

Rollouts trained at step t were sampled by the policy of version t-2 (one update behind the
trained policy, whose version is t-1 before its update): staleness 1. With
`trainer.max_staleness_steps = k > 1` a weight sync is skipped while the next launched batch
would still be at most k versions behind, saving sync time for staleness. The bound, the sync
decision and where the PPO ratio's old logprobs come from are every source's staleness policy
(`skylift.rl.staleness`).

Generation runs on the run's one event loop (`skylift.utils.loop_thread.LoopThread`: a thread of
its own for the whole run) as one more task (`BackgroundRollouts`), so the main thread keeps
training and may use the loop meanwhile. This works for every kind of engine: in-process vLLM
engines (their `AsyncLLM` lives on that loop), Ray actors (awaited object refs) and remote HTTP
servers (the client session is bound to that loop).
"""

from __future__ import annotations

import time
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from skylift.utils.loop_thread import LoopThread

T = TypeVar("T")


class BackgroundRollouts(Generic[T]):
    """At most one generation at a time, on the run's loop thread while the caller goes on.

    `launch(coro)` returns at once; `join()` blocks until the generation is done and says how long
    the caller waited and how long it ran; `take()` hands its result over. The loop stays open to
    the caller meanwhile (weight sync, evaluation): a generation is one more task on it.
    """

    def __init__(self, loop: LoopThread) -> None:
        self.loop = loop
        self._future: Future[tuple[T, float]] | None = None
        self._result: T | None = None
        self._has_result = False

    @property
    def pending(self) -> bool:
        """A generation is in flight or its result was not taken yet."""
        return self._future is not None or self._has_result

    def launch(self, coro: Coroutine[Any, Any, T]) -> None:
        if self.pending:
            coro.close()
            raise RuntimeError("the previous generation was not taken yet")
        self._future = self.loop.submit(self._timed(coro))

    @staticmethod
    async def _timed(coro: Coroutine[Any, Any, T]) -> tuple[T, float]:
        started = time.perf_counter()
        result = await coro
        return result, time.perf_counter() - started

    def join(self) -> tuple[float, float]:
        """Block until the generation in flight is done: (seconds waited here, seconds it ran).

        (0, 0) when it was already joined; re-raises the generation's error.
        """
        if self._future is None:
            return 0.0, 0.0
        started = time.perf_counter()
        try:
            self._result, generate_s = self._future.result()
        finally:
            self._future = None
        self._has_result = True
        return time.perf_counter() - started, generate_s

    def take(self) -> T:
        """The finished generation's result (joins it first if needed)."""
        self.join()
        if not self._has_result:
            raise RuntimeError("no generation was launched")
        result, self._result, self._has_result = self._result, None, False
        return result  # type: ignore[return-value]

    def close(self) -> None:
        """Wait for a generation still in flight (its result or error is dropped)."""
        if self._future is not None:
            try:
                self._future.result()
            except Exception:  # noqa: BLE001 - shutting down after another error; keep that one
                pass
            self._future = None
        self._result, self._has_result = None, False
