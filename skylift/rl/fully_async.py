"""Fully asynchronous training (`trainer.fully_async.enabled`): generation never waits for training.

Design:

1. `num_parallel_generation_workers` coroutines on the run's event loop (the runtime's
   `LoopThread`, on a thread of its own for the whole run) each take the next prompt, generate its group of
   `n_samples_per_prompt` rollouts and put the group into a buffer; then take the next prompt.
2. The trainer takes `train_batch_size` groups from the buffer as soon as that many are done
   (the oldest first), trains on them and syncs the weights after every update. A sync pauses the
   engines (`pause_mode`: "keep" freezes the requests in flight, "abort" ends them and the
   generator resubmits prompt + tokens so far), broadcasts, resets the prefix cache and resumes
   them, labelling the tokens they sample from then on with the new policy version.
3. So one rollout may span several policy versions: every token records the version that sampled
   it (`Trajectory.token_versions`, from vLLM's weight-version spans); a rollout's version is
   its oldest token's. Its logprobs are those of the weights that sampled each token, and
   truncated importance sampling against the trainer's logprobs (`trainer.algorithm.use_tis`)
   corrects the gap.
4. Staleness is bounded by admission (`StalenessGate`: a group may start only while at most
   `(engine_version + max_staleness_steps + 1) * train_batch_size` groups were started, net of
   dropped ones: the bounded buffer) and enforced when a batch is taken (`take_fresh`): a group
   older than the bound is dropped and its prompt generated again. Every step logs the
   staleness of its batch (`fully_async/*`, `async/staleness_*`); it never exceeds the bound.
5. Each group records its completion seconds (from its generation's start to its end, on the
   `clock`), for the metrics plugins' group figures of the step that trains it
   (`skylift.generator.metrics.GroupTimes`).
6. `keep` (`trainer.fully_async.sample_full_batch`): a finished group it turns down (rewards all
   equal) is not buffered; its prompt counts as used and its slot is given back, so the batch
   fills with groups that carry a signal. Running out of data then raises `RolloutsExhausted`,
   which ends the run.

Resuming loses no prompt and repeats none. Every prompt has a position in the run's data order
(`step * train_batch_size + index` in its step's batch), and a checkpoint records, at one instant
under the buffer's lock, the position of the next prompt not yet started and the positions
started but not trained: buffered, in flight, or dropped as too stale and waiting to be
generated again (`StreamPosition`, in `TrainerState.rollouts`). A resumed run generates those
pending prompts first (with the resumed weights; their per-prompt seeds are their data step's),
then goes on from the next position, so it trains on exactly the prompts an uninterrupted run
does, however far generation had run ahead of training when the run was killed. Prompts `keep`
turned down count as used. Without `keep`, generation stops at the run's last step's prompts.
"""

from __future__ import annotations

import asyncio
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, TypeVar

from skylift.generator import Trajectory
from skylift.generator.timing import Clock
from skylift.utils.loop_thread import LoopThread

T = TypeVar("T")


# ================================================================== pure parts (unit-tested)
@dataclass
class StalenessGate:
    """Admission control: how many prompt groups may have started, given the engines' version.

    A group started while the engines hold version v is trained at the earliest with the
    `(k // batch_size)`-th update if it is the k-th group started; starting at most
    `(v + max_staleness + 1) * batch_size` groups (dropped ones given back) keeps groups trained
    in order within `max_staleness` versions of the weights that started them.
    """

    batch_size: int
    max_staleness: int
    max_in_flight: int
    base_version: int = 0  # the engines' version when generation began (a resumed run's step)
    started: int = 0
    dropped: int = 0
    in_flight: int = 0

    def capacity(self, engine_version: int) -> int:
        """Groups that may have started in total while the engines hold `engine_version`."""
        ahead = engine_version - self.base_version + self.max_staleness + 1
        return ahead * self.batch_size + self.dropped

    def may_start(self, engine_version: int) -> bool:
        return self.in_flight < self.max_in_flight and self.started < self.capacity(engine_version)

    def start(self) -> None:
        self.started += 1
        self.in_flight += 1

    def finish(self) -> None:
        self.in_flight -= 1

    def drop(self, count: int = 1) -> None:
        """Groups taken out as too stale: their slots can be used again."""
        self.dropped += count


@dataclass
class Group:
    """The rollouts of one prompt, generated together."""

    trajectories: list[Trajectory]
    row: Any
    step: int  # the data position's step (its seeds), not the step that trains it
    finished_at: float = field(default_factory=time.perf_counter)
    completion_s: float | None = None  # from its generation's start to its end (None: not measured)
    position: int = -1  # its prompt's place in the run's data order (`Prompt.position`)

    @property
    def version(self) -> int:
        """The oldest policy version among the group's tokens."""
        return min(tr.policy_version for tr in self.trajectories)


def take_fresh(
    buffer: Sequence[Group], policy_version: int, max_staleness: int, batch_size: int
) -> tuple[list[Group], list[Group], list[Group]]:
    """Split the buffer for a batch trained at `policy_version`: (taken, dropped, kept).

    Groups older than `max_staleness` versions are dropped; of the others, the `batch_size`
    oldest (by version, then by completion) are taken, or none while fewer are ready.
    """
    fresh = [g for g in buffer if policy_version - g.version <= max_staleness]
    dropped = [g for g in buffer if policy_version - g.version > max_staleness]
    if len(fresh) < batch_size:
        return [], dropped, fresh
    order = sorted(range(len(fresh)), key=lambda i: (fresh[i].version, fresh[i].finished_at))
    chosen = set(order[:batch_size])
    taken = [fresh[i] for i in sorted(chosen, key=order.index)]
    kept = [g for i, g in enumerate(fresh) if i not in chosen]
    return taken, dropped, kept


def token_version_metrics(trajectories: Sequence[Trajectory], policy_version: int) -> dict[str, float]:
    """Per-token staleness of a batch trained at `policy_version` (sampled tokens only)."""
    lags: list[int] = []
    versions: set[int] = set()
    spanning = 0
    for tr in trajectories:
        labels = tr.token_versions or [tr.policy_version] * len(tr.response_ids)
        sampled = [v for v, m in zip(labels, tr.loss_mask, strict=False) if m] or [tr.policy_version]
        versions.update(sampled)
        spanning += len(set(sampled)) > 1
        lags.extend(policy_version - v for v in sampled)
    return {
        "fully_async/token_staleness_mean": statistics.fmean(lags) if lags else 0.0,
        "fully_async/token_staleness_max": float(max(lags)) if lags else 0.0,
        "fully_async/versions_in_batch": float(len(versions)),
        "fully_async/samples_spanning_versions": float(spanning),
    }


# ================================================================== the generation side
class Prompt(NamedTuple):
    """A prompt to generate: its row, its data step (its seeds) and its position in the run's data
    order (`step * batch_size + index`; what a checkpoint records)."""

    row: Any
    step: int
    position: int


@dataclass
class PromptSource:
    """Prompts to generate, in data order, each with its data step; `again` (dropped ones, a
    resumed run's pending ones) come first. `position` is the next row's place in the data order."""

    rows: Iterator[tuple[Any, int]]
    again: deque[Prompt] = field(default_factory=deque)
    position: int = 0

    def next(self) -> Prompt | None:
        if self.again:
            return self.again.popleft()
        item = next(self.rows, None)
        if item is None:
            return None
        prompt = Prompt(item[0], item[1], self.position)
        self.position += 1
        return prompt


@dataclass(frozen=True)
class StreamPosition:
    """How far a fully async run got through its data, at one instant: every position below
    `next_position` was started, and of those `pending` were not trained yet (buffered, in
    flight or waiting to be generated again); the rest were trained or turned down."""

    next_position: int
    pending: tuple[int, ...]
    batch_size: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "next_position": self.next_position,
            "pending": list(self.pending),
            "batch_size": self.batch_size,
        }

    @classmethod
    def from_dict(cls, saved: dict[str, Any]) -> StreamPosition:
        return cls(
            int(saved["next_position"]), tuple(int(p) for p in saved["pending"]), int(saved["batch_size"])
        )


GroupFn = Callable[[Any, int, int], Coroutine[Any, Any, list[Trajectory]]]
"""(row, data step, engine version) -> the group's trajectories."""


class RolloutsExhausted(RuntimeError):
    """The data ran out before a batch was ready (with `sample_full_batch`, the run ends there)."""


class FullyAsyncRollouts:
    """Generation workers filling a bounded buffer on a `LoopThread`; `take` blocks for a batch."""

    def __init__(
        self,
        loop: LoopThread,
        source: PromptSource,
        generate_group: GroupFn,
        engine_version: Callable[[], int],
        *,
        batch_size: int,
        max_staleness: int,
        workers: int,
        timeout_s: float,
        clock: Clock = time.monotonic,
        keep: Callable[[list[Trajectory]], bool] | None = None,
    ) -> None:
        """`keep`: whether a finished group goes into the buffer (None: all do). A group it turns
        down counts as used (its prompt is not generated again) and gives its slot back
        (`trainer.fully_async.sample_full_batch`)."""
        self.loop = loop
        self.keep = keep
        self.turned_down = 0  # groups `keep` turned down, all run long
        self.turned_down_groups: list[Group] = []  # those since the last `take`
        self.last_turned_down: list[Group] = []  # those the last `take` saw, for its figures
        self.clock = clock  # times each group's generation
        self.source = source
        self.generate_group = generate_group
        self.engine_version = engine_version
        self.batch_size = batch_size
        self.max_staleness = max_staleness
        self.timeout_s = timeout_s
        self.gate = StalenessGate(batch_size, max_staleness, workers, base_version=engine_version())
        self._lock = threading.Condition()
        self._buffer: list[Group] = []
        self._in_flight: dict[int, Prompt] = {}  # by position
        self._error: BaseException | None = None
        self._exhausted = False  # the data order has no prompt left (`again` may still get some)
        self._closing = False
        self._wakeup: asyncio.Event | None = None
        self._tasks: list[asyncio.Task[None]] = []
        loop.submit(self._start(workers)).result(timeout=60)

    async def _start(self, workers: int) -> None:
        self._wakeup = asyncio.Event()
        self._tasks = [asyncio.create_task(self._worker()) for _ in range(workers)]

    # ---- loop thread
    async def _worker(self) -> None:
        assert self._wakeup is not None
        while True:
            self._wakeup.clear()
            with self._lock:
                if self._closing or self._error is not None:
                    return
                item = self.source.next() if self.gate.may_start(self.engine_version()) else False
                if item is None:  # the data is used up; a group dropped as too stale may come back
                    self._exhausted = True
                    self._lock.notify_all()
                    item = False
                elif item is not False:
                    self.gate.start()
                    self._in_flight[item.position] = item
            if item is False:
                await self._wakeup.wait()
                continue
            began = self.clock()
            try:
                trajectories = await self.generate_group(item.row, item.step, self.engine_version())
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the trainer's thread by take()
                with self._lock:
                    self._error = exc
                    self.gate.finish()  # its prompt stays pending (in flight) for a checkpoint
                    self._lock.notify_all()
                return
            completion_s = self.clock() - began
            with self._lock:
                self.gate.finish()
                del self._in_flight[item.position]
                group = Group(
                    trajectories, item.row, item.step, completion_s=completion_s, position=item.position
                )
                kept = self.keep is None or self.keep(trajectories)
                if kept:
                    self._buffer.append(group)
                else:
                    self.gate.drop()
                    self.turned_down += 1
                    self.turned_down_groups.append(group)
                self._lock.notify_all()
            if not kept:
                self._wakeup.set()  # its slot is free: a waiting worker may start a group

    def _wake_workers(self) -> None:
        if self._wakeup is not None:
            self.loop.loop.call_soon_threadsafe(self._wakeup.set)

    # ---- trainer thread
    def notify_version(self) -> None:
        """The engines hold a newer version: more groups may start."""
        self._wake_workers()

    def take(self, policy_version: int) -> tuple[list[Group], dict[str, float]]:
        """Block until `batch_size` groups within the staleness bound are done; the groups (oldest
        first) and the buffer's figures. Too-stale groups are dropped and their prompts generated
        again. The groups `keep` turned down since the last call are then in `last_turned_down`."""
        started = time.perf_counter()
        dropped_total = 0
        deadline = started + self.timeout_s
        with self._lock:
            while True:
                if self._error is not None:
                    raise self._error
                taken, dropped, kept = take_fresh(
                    self._buffer, policy_version, self.max_staleness, self.batch_size
                )
                if dropped:
                    dropped_total += len(dropped)
                    self.gate.drop(len(dropped))
                    self.source.again.extend(Prompt(g.row, g.step, g.position) for g in dropped)
                    self._wake_workers()
                self._buffer = kept
                if taken:
                    break
                if self._exhausted and self.gate.in_flight == 0 and not self.source.again:
                    turned_down = (
                        f" ({self.turned_down} groups without a reward spread dropped)" if self.keep else ""
                    )
                    raise RolloutsExhausted(
                        f"fully async: the data ran out with {len(self._buffer)} of {self.batch_size} "
                        f"groups of a batch generated{turned_down}"
                    )
                left = deadline - time.perf_counter()
                if left <= 0:
                    raise TimeoutError(
                        f"fully async: the trainer waited {self.timeout_s:.0f} s for {self.batch_size} groups "
                        f"from the generation workers ({len(self._buffer)} ready, {self.gate.in_flight} in "
                        "flight); generator.http_timeout_s bounds the wait"
                    )
                self._lock.wait(min(left, 1.0))
            in_flight, buffered = self.gate.in_flight, len(self._buffer)
            self.last_turned_down, self.turned_down_groups = self.turned_down_groups, []
        trajectories = [tr for g in taken for tr in g.trajectories]
        metrics = {
            "fully_async/wait_s": time.perf_counter() - started,
            "fully_async/dropped_groups": float(dropped_total),
            "fully_async/buffered_groups": float(buffered),
            "fully_async/in_flight_groups": float(in_flight),
            "fully_async/groups_started": float(self.gate.started),
            **token_version_metrics(trajectories, policy_version),
        }
        return taken, metrics

    def position(self) -> StreamPosition:
        """Where the run is in its data now (for a checkpoint taken after a step): the next
        prompt to start and the started ones no step took yet."""
        with self._lock:
            pending = [p.position for p in self.source.again]
            pending += [*self._in_flight, *(g.position for g in self._buffer)]
            return StreamPosition(self.source.position, tuple(sorted(pending)), self.batch_size)

    def close(self) -> None:
        """Cancel the generation in flight (the engines abort its requests) and stop the workers."""
        with self._lock:
            self._closing = True

        async def cancel() -> None:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)

        self.loop.submit(cancel()).result(timeout=120)  # the loop is the run's: it goes on
