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
would still be at most k versions behind (`needs_weight_sync`), saving sync time for staleness.
The bound is checked before every update (`check_staleness`).

Generation runs on the trainer's event loop, driven by one background thread only while a
generation is in flight (`BackgroundRollouts`); the main thread never touches the loop until it
has waited for that generation. This works for every kind of engine: in-process vLLM engines
(their `AsyncLLM` lives on that loop), Ray actors (awaited object refs) and remote HTTP servers
(the client session is bound to that loop).

Off-policy correction (`ppo_old_logprobs_source`): the rollout logprobs come from an older policy.
Without TIS they are the PPO ratio's `old_logprobs`, so the clip acts on the real off-policy gap;
with `trainer.algorithm.use_tis` (or any `trainer.algorithm.off_policy_correction`) the trainer's
logprobs before the update are `old_logprobs` (the clip's anchor) and every token is reweighted by
`min(pi_old / pi_rollout, tis_imp_ratio_cap)` (decoupled PPO with truncated importance sampling),
or per sequence, or masked (skylift.algorithms.off_policy).
"""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Coroutine, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Generic, Literal, TypeVar

T = TypeVar("T")


class BackgroundRollouts(Generic[T]):
    """At most one generation at a time, run on `loop` by a background thread.

    `launch(coro)` returns at once; `join()` blocks until the generation is done and says how long
    the caller waited and how long it ran; `take()` hands its result over. While a generation is
    in flight the loop belongs to the background thread: the caller must `join()` before using
    the loop itself (weight sync, evaluation, shutdown).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="skylift-rollouts")
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
        self._future = self._pool.submit(self._drive, coro)

    def _drive(self, coro: Coroutine[Any, Any, T]) -> tuple[T, float]:
        started = time.perf_counter()
        result = self.loop.run_until_complete(coro)
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
        """Wait for a generation still in flight (its result or error is dropped), stop the thread."""
        if self._future is not None:
            try:
                self._future.result()
            except Exception:  # noqa: BLE001 - shutting down after another error; keep that one
                pass
            self._future = None
        self._result, self._has_result = None, False
        self._pool.shutdown(wait=True)


def needs_weight_sync(
    policy_version: int, engine_version: int, async_training: bool, max_staleness: int
) -> bool:
    """Whether to broadcast weights after an update, so the next batch launched stays within bounds.

    Synchronous: the next batch is sampled and trained at `policy_version`, so any lag needs a sync.
    Asynchronous: the next batch launched is trained one update later (at `policy_version + 1`);
    its staleness `policy_version + 1 - engine_version` must stay <= `max_staleness`.
    """
    if policy_version == engine_version:
        return False
    if not async_training:
        return True
    return policy_version + 1 - engine_version > max_staleness


def staleness_metrics(policy_version: int, rollout_versions: Sequence[int]) -> dict[str, float]:
    """Staleness of a batch trained at `policy_version` (before its update), for the step's metrics."""
    lags = [policy_version - v for v in rollout_versions]
    return {
        "async/policy_version": float(policy_version),
        "async/rollout_version_min": float(min(rollout_versions)),
        "async/staleness_max": float(max(lags)),
        "async/staleness_mean": statistics.fmean(lags),
    }


def check_staleness(policy_version: int, rollout_versions: Sequence[int], max_staleness: int) -> None:
    """Raise if any rollout is more than `max_staleness` versions behind or from the future."""
    oldest, newest = min(rollout_versions), max(rollout_versions)
    if policy_version - oldest > max_staleness or newest > policy_version:
        raise RuntimeError(
            f"rollouts of policy versions {oldest}..{newest} trained at version {policy_version}: "
            f"staleness must be in [0, {max_staleness}] (trainer.max_staleness_steps)"
        )


def ppo_old_logprobs_source(
    async_training: bool, corrects: bool, multiple_updates: bool
) -> Literal["rollout", "trainer"] | None:
    """Where the PPO ratio's `old_logprobs` come from.

    - "rollout": the engine's logprobs of the sampled tokens (async without a correction: the
      ratio and its clip measure the real gap to the policy that sampled);
    - "trainer": a forward pass of the policy before this step's updates (several updates per
      batch, a KL penalty in the reward, or async with a correction (`corrects`: TIS, an
      off-policy mask, rollout_is) of the gap between them and the rollout logprobs);
    - None: exactly on-policy, one update: the current logprobs, detached.
    """
    if async_training:
        return "trainer" if corrects else "rollout"
    return "trainer" if multiple_updates else None
