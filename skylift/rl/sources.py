"""Rollout sources: where a training step's trajectories come from.

The loop asks a `RolloutSource` for the step's batch (`take`), lets it start the next step's
generation while the policy trains (`prefetch`), and tells it around every weight sync
(`before_sync`, `needs_sync`, `after_sync`). A checkpoint saves where the source is in the data
(`state`) and a resumed run gives it back (`restore`), so a run killed at any point and resumed
trains on exactly the prompts an uninterrupted run does. Three schedules, one interface:

- `SyncSource`: generate the step's prompts, then train (on-policy).
- `OneStepOffSource`: step t+1 is generated while step t trains; syncs wait for that generation
  (design in `skylift.rl.one_step_off`).
- `FullyAsyncSource`: generation never stops; every sync pauses the engines with requests in flight
  (design in `skylift.rl.fully_async`).

`DynamicSampling` wraps any of them: it keeps the groups whose rewards differ and samples extra
rounds of prompts until the batch is full (`skylift.rl.dynamic_sampling`).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from skylift.generator import Trajectory
from skylift.generator.metrics import GroupTimes, MetricsRequest, plugin_metrics
from skylift.generator.timing import Clock
from skylift.rl.dynamic_sampling import dynamic_sample, zero_variance_uids
from skylift.rl.fully_async import FullyAsyncRollouts, Prompt, PromptSource, StreamPosition
from skylift.rl.one_step_off import BackgroundRollouts
from skylift.rl.rows import StepRows
from skylift.rl.sampling import Sampler
from skylift.rl.staleness import needs_weight_sync


@dataclass
class RolloutTiming:
    """A step's generation figures: seconds the engines generated its rollouts, and seconds the
    trainer waited for them."""

    generate_s: float = 0.0
    wait_s: float = 0.0

    def add(self, generate_s: float, wait_s: float) -> None:
        self.generate_s += generate_s
        self.wait_s += wait_s

    def metrics(self) -> dict[str, float]:
        return {"timing/generate_s": self.generate_s, "timing/wait_s": self.wait_s}


@dataclass
class Rollouts:
    """A step's batch of trajectories and what the source says about it."""

    trajectories: list[Trajectory]
    metrics: dict[str, float] = field(default_factory=dict)


class RolloutSource(Protocol):
    sampler: Sampler
    """How it asks for rollouts: its request (`sampler.params`) is the one the trainer takes the
    policy's logprobs under."""
    overlapped: bool
    """Generation runs on a thread beside training (the GIL changes hands more often)."""
    may_run_out: bool
    """`take` may raise `RolloutsExhausted` before the last step: the run then ends there."""

    def take(self, step: int, policy_version: int) -> Rollouts:
        """The trajectories step `step` (0-based) trains on; the policy is at `policy_version`."""
        ...

    def prefetch(self, step: int) -> None:
        """Step `step`'s batch may be generated from now on (while the current step trains)."""
        ...

    def before_sync(self) -> None:
        """A weight sync follows: no generation may read weights that are being replaced."""
        ...

    def needs_sync(self, policy_version: int, engine_version: int) -> bool:
        """Whether the engines must get the policy's new weights now."""
        ...

    def after_sync(self, policy_version: int) -> None:
        """The sync is done (or skipped); the engines hold their newest weights."""
        ...

    def timing(self) -> RolloutTiming:
        """The step's generation figures, read once after its sync."""
        ...

    def state(self) -> dict[str, Any]:
        """What a checkpoint taken after the current step must record to resume without losing or
        repeating a prompt (JSON-ready; {} when the step alone says it)."""
        ...

    def restore(self, state: dict[str, Any]) -> None:
        """A resumed run's source: `state` as `state()` saved it (before the first `take`)."""
        ...

    def close(self) -> None: ...


class SyncSource:
    """Generate the step's prompts with the current weights, then train on them."""

    overlapped = False
    may_run_out = False

    def __init__(self, rows: StepRows, sampler: Sampler) -> None:
        self.rows, self.sampler = rows, sampler
        self._timing = RolloutTiming()

    def take(self, step: int, policy_version: int) -> Rollouts:
        tick = time.perf_counter()
        trajectories = self.sampler.run(self.rows.first_round(step), step)
        spent = time.perf_counter() - tick
        self._timing.add(spent, spent)
        return Rollouts(trajectories)

    def prefetch(self, step: int) -> None:
        pass

    def before_sync(self) -> None:
        pass

    def needs_sync(self, policy_version: int, engine_version: int) -> bool:
        return needs_weight_sync(policy_version, engine_version, False, 0)

    def after_sync(self, policy_version: int) -> None:
        pass

    def timing(self) -> RolloutTiming:
        timing, self._timing = self._timing, RolloutTiming()
        return timing

    def state(self) -> dict[str, Any]:
        """{}: step t trains the rows of step t (one-step-off: its generation launched during step
        t-1 is not saved, the resumed run generates the same prompts with the same seeds again)."""
        return {}

    def restore(self, state: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass


class OneStepOffSource(SyncSource):
    """Step t+1's prompts are generated (with the weights before step t's update) while step t
    trains; a sync waits for that generation and is skipped while the rollouts launched next would
    stay within `max_staleness` versions."""

    overlapped = True

    def __init__(self, rows: StepRows, sampler: Sampler, total_steps: int, max_staleness: int) -> None:
        super().__init__(rows, sampler)
        self.total_steps, self.max_staleness = total_steps, max_staleness
        self.background: BackgroundRollouts[list[Trajectory]] = BackgroundRollouts(sampler.loop)
        self._failed: Exception | None = None  # the next step's generation failed (raised by take)

    def take(self, step: int, policy_version: int) -> Rollouts:
        if self._failed is not None:
            failed, self._failed = self._failed, None
            raise failed
        if not self.background.pending:  # the first step: nothing was launched ahead
            self.prefetch(step)
            self._timing.add(*reversed(self.background.join()))
        return Rollouts(self.background.take())

    def prefetch(self, step: int) -> None:
        if step < self.total_steps:
            self.background.launch(self.sampler.coroutine(self.rows.first_round(step), step))

    def before_sync(self) -> None:
        """Wait for the next step's generation (the sync needs the loop). Its failure is raised
        when that step takes it: this step's update still syncs, counts and can be saved."""
        try:
            waited, generated = self.background.join()
        except Exception as exc:  # noqa: BLE001 - kept for take()
            self._failed = exc
            return
        self._timing.add(generated, waited)

    def needs_sync(self, policy_version: int, engine_version: int) -> bool:
        return needs_weight_sync(policy_version, engine_version, True, self.max_staleness)

    def close(self) -> None:
        self.background.close()


class FullyAsyncSource:
    """Prompt groups generated continuously into a bounded buffer on the loop's own thread; each
    step takes `batch_size` groups within `max_staleness` versions, and each sync pauses the
    engines with their requests in flight."""

    overlapped = True

    def __init__(
        self,
        rows: StepRows,
        sampler: Sampler,
        *,
        label_engines: Callable[[], None],
        total_steps: int,
        max_staleness: int,
        workers: int,
        timeout_s: float,
        clock: Clock = time.monotonic,
        zero_variance_tol: float | None = None,
    ) -> None:
        """`zero_variance_tol` set: groups whose rewards lie within it are dropped as they finish
        (`trainer.fully_async.sample_full_batch`), and running out of data ends the run; else
        generation stops at the prompts of step `total_steps`."""
        self.rows, self.sampler, self.label_engines = rows, sampler, label_engines
        self.total_steps = total_steps
        self.zero_variance_tol = zero_variance_tol
        self.may_run_out = zero_variance_tol is not None
        self.max_staleness, self.workers, self.timeout_s = max_staleness, workers, timeout_s
        self.clock = clock  # times each group's generation
        self.stream: FullyAsyncRollouts | None = None
        self._resumed: StreamPosition | None = None  # a checkpoint's position, until the stream starts
        self._step_started = self._paused_at = 0.0
        self._paused_s = self._wait_s = 0.0

    def _start(self, step: int) -> FullyAsyncRollouts:
        """Start generating at the restored position in the data (its pending prompts first), else
        at step `step`'s rows."""
        self.label_engines()  # the engines label the tokens they sample with their version
        size = self.rows.batch_size
        last = self.rows.total if self.may_run_out else min(self.total_steps, self.rows.total)
        end = last * size
        at = self._resumed or StreamPosition(step * size, (), size)
        again = deque(Prompt(*self.rows.at(p), p) for p in at.pending if p < end)
        return FullyAsyncRollouts(
            self.sampler.loop,
            PromptSource(self.rows.stream(at.next_position, end), again, at.next_position),
            lambda row, at, _version: self.sampler.coroutine([row], at),
            self.sampler.engine_version,
            batch_size=self.rows.batch_size,
            max_staleness=self.max_staleness,
            workers=self.workers,
            timeout_s=self.timeout_s,
            clock=self.clock,
            keep=None if self.zero_variance_tol is None else self._has_reward_spread,
        )

    def _has_reward_spread(self, group: list[Trajectory]) -> bool:
        return not zero_variance_uids(group, self.zero_variance_tol or 0.0)

    def take(self, step: int, policy_version: int) -> Rollouts:
        self._step_started, self._paused_s = time.perf_counter(), 0.0
        if self.stream is None:
            self.stream = self._start(step)
            self._resumed = None
        taken, metrics = self.stream.take(policy_version)
        self._wait_s = metrics["fully_async/wait_s"]
        kept = [(g.trajectories, g.completion_s) for g in taken]
        dropped = [(g.trajectories, g.completion_s) for g in self.stream.last_turned_down]
        filtered = self.stream.keep is not None
        times = GroupTimes(kept, dropped, self.sampler.n, filtered=filtered)
        metrics.update(plugin_metrics(MetricsRequest(groups=times)))
        return Rollouts([tr for g in taken for tr in g.trajectories], metrics)

    def prefetch(self, step: int) -> None:
        pass  # generation never stops

    def before_sync(self) -> None:
        self._paused_at = time.perf_counter()  # the sync pauses the engines

    def needs_sync(self, policy_version: int, engine_version: int) -> bool:
        return policy_version != engine_version

    def after_sync(self, policy_version: int) -> None:
        self._paused_s += time.perf_counter() - self._paused_at
        if self.stream is not None:
            self.stream.notify_version()  # more groups may start

    def timing(self) -> RolloutTiming:
        """The engines generated all step long except while paused for the sync."""
        busy = time.perf_counter() - self._step_started - self._paused_s
        return RolloutTiming(max(0.0, busy), self._wait_s)

    def state(self) -> dict[str, Any]:
        """The stream's position in the data (`StreamPosition`): the next prompt to start and the
        started ones not trained yet, which a resumed run generates first."""
        at = self.stream.position() if self.stream is not None else self._resumed
        return {"fully_async": at.to_dict()} if at is not None else {}

    def restore(self, state: dict[str, Any]) -> None:
        """Resume at a checkpoint's position (a checkpoint without one: at its step's rows)."""
        saved = state.get("fully_async")
        if saved is None:
            return
        at = StreamPosition.from_dict(saved)
        if at.batch_size != self.rows.batch_size:
            raise ValueError(
                f"the checkpoint's fully async position counts batches of {at.batch_size} prompts: resume "
                f"with trainer.train_batch_size={at.batch_size} (this run has {self.rows.batch_size})"
            )
        self._resumed = at

    def close(self) -> None:
        if self.stream is not None:
            self.stream.close()
            self.stream = None


class DynamicSampling:
    """Around any source: the step's batch made of prompt groups whose rewards differ, sampling
    extra rounds of the step's own draw of prompts when needed (`filter` or `replace`)."""

    def __init__(
        self,
        inner: RolloutSource,
        rows: StepRows,
        sampler: Sampler,
        *,
        mode: str,
        batch_size: int,
        per_round: int,
        max_rounds: int | None,
        min_replace_ratio: float,
        seed: int,
        say: Callable[[str], None],
    ) -> None:
        self.inner, self.rows, self.sampler = inner, rows, sampler
        self.overlapped, self.may_run_out = inner.overlapped, inner.may_run_out
        self.mode, self.batch_size, self.per_round = mode, batch_size, per_round
        self.max_rounds, self.min_replace_ratio, self.seed = max_rounds, min_replace_ratio, seed
        self.say = say
        self._extra_s = 0.0

    def take(self, step: int, policy_version: int) -> Rollouts:
        first = self.inner.take(step, policy_version)
        tick = time.perf_counter()
        taken = {tr.uid for tr in first.trajectories}

        def sample_round(round_index: int) -> list[Trajectory]:
            rows = self.rows.draw(step, (round_index - 1) * self.per_round, self.per_round, taken)
            return self.sampler.run(rows, step) if rows else []

        out = dynamic_sample(
            first.trajectories,
            sample_round,
            self.mode,
            self.batch_size,
            self.max_rounds,
            self.min_replace_ratio,
            seed=self.seed + step,
        )
        self._extra_s += time.perf_counter() - tick
        if out.short:
            self.say(
                f"step {step + 1}: dynamic sampling ({self.mode}) found {out.groups_kept} of "
                f"{self.batch_size} prompt groups with mixed rewards in {out.rounds} round(s) "
                f"({out.groups_sampled} groups sampled); training on what there is"
            )
        metrics = {
            **first.metrics,
            "dynamic_sampling/groups_sampled": float(out.groups_sampled),
            "dynamic_sampling/groups_kept": float(out.groups_kept),
            "dynamic_sampling/rounds": float(out.rounds),
        }
        return Rollouts(out.trajectories, metrics)

    def prefetch(self, step: int) -> None:
        self.inner.prefetch(step)

    def before_sync(self) -> None:
        self.inner.before_sync()

    def needs_sync(self, policy_version: int, engine_version: int) -> bool:
        return self.inner.needs_sync(policy_version, engine_version)

    def after_sync(self, policy_version: int) -> None:
        self.inner.after_sync(policy_version)

    def state(self) -> dict[str, Any]:
        """The inner source's: a step's extra rounds are its own seeded draws, made again alike."""
        return self.inner.state()

    def restore(self, state: dict[str, Any]) -> None:
        self.inner.restore(state)

    def timing(self) -> RolloutTiming:
        """The inner source's figures; extra rounds are generated while the trainer waits."""
        timing = self.inner.timing()
        timing.add(self._extra_s, self._extra_s)
        self._extra_s = 0.0
        return timing

    def close(self) -> None:
        self.inner.close()
