"""Each rollout's wall-clock time, split as `Trajectory.timing` holds it, for the metrics plugins'
per-rollout time figures (`skylift.generator.metrics.METRICS`).

``completion``: from the rollout's start (before its environment's ``init``) to its end (after the
environment's ``close``); ``llm``: the seconds spent awaiting the engine for it (resubmits of an
aborted sample included); ``env``: the seconds spent in its environment's ``step`` calls (not
``init``/``close``). A batched single-turn rollout shares its engine call with the batch:
its ``llm`` is that call's duration (or its row's, with per-row seeds) and its ``completion`` runs
from the batch's start.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

#: a monotonic clock in seconds (`time.monotonic`, or a test's fake)
Clock = Callable[[], float]

#: the split of a rollout's completion time the generators record
SPLITS = ("llm", "env")


class TrajectoryTimer:
    """One rollout's clock: started when made (or at `start`), with its ``llm`` and ``env`` seconds."""

    def __init__(self, clock: Clock = time.monotonic, start: float | None = None) -> None:
        self.clock = clock
        self.start = clock() if start is None else start
        self.split = dict.fromkeys(SPLITS, 0.0)

    async def timed(self, name: str, call: Awaitable[T]) -> T:
        """`call` awaited, its seconds added to split `name`."""
        began = self.clock()
        try:
            return await call
        finally:
            self.split[name] += self.clock() - began

    def add(self, name: str, seconds: float) -> None:
        self.split[name] += seconds

    def times(self) -> dict[str, float]:
        """``completion`` (seconds since the start) and the splits, for `Trajectory.timing`."""
        return {"completion": self.clock() - self.start, **self.split}
