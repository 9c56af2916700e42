"""The engines' weights of a colocated run, with the trainer's state in host memory while the
engines are awake (`trainer.placement.colocate_all=true` on GPUs).

The RL loop puts the engines to sleep before each update and wakes them for the weight sync
(`EngineWeights.sleep` / `sync`). `OffloadingEngineWeights` adds the trainer's side, as SkyRL's
and verl's colocated trainers do with `offload` / `backload`:

- after the engines sleep: every training worker's state back on its GPU (`backload_to_device`);
- before they wake: the reference's and the critic's state, and the policy's optimizer state
  (`trainer.policy.optimizer_config.offload_after_step`, the critic's likewise), to host memory;
- after the push (the policy's parameters are read on the GPU): the policy's parameters too.

So while an engine is awake the trainer holds no more than its CUDA contexts (and the optimizer
state where `offload_after_step=false`); `skylift.cluster.colocation.engine_memory_split` sizes the
engines from that. A worker method that needs its state brings it back itself
(`skylift.worker.offload.OffloadingWorker`): a checkpoint taken while the engines are awake works,
at the cost of the memory it needs then.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from skylift.cluster.worker_group import RLWorker, WorkerGroup
from skylift.config.schema import SkyliftConfig
from skylift.worker.offload import MODEL, OPTIMIZER


@dataclass(frozen=True)
class OffloadedGroup:
    """One worker group and the parts of its state offloaded before the engines wake."""

    group: WorkerGroup
    before_wake: tuple[str, ...]
    after_push: tuple[str, ...] = ()


def offloaded_groups(
    cfg: SkyliftConfig, policy: WorkerGroup, ref: WorkerGroup | None, critic: WorkerGroup | None
) -> list[OffloadedGroup]:
    """Which state of which group leaves the GPU while the engines are awake."""
    t = cfg.trainer
    policy_optimizer = (OPTIMIZER,) if t.policy.optimizer_config.offload_after_step else ()
    groups = [OffloadedGroup(policy, before_wake=policy_optimizer, after_push=(MODEL,))]
    if ref is not None:
        groups.append(OffloadedGroup(ref, before_wake=(MODEL,)))
    if critic is not None:
        critic_optimizer = (OPTIMIZER,) if t.critic.optimizer_config.offload_after_step else ()
        groups.append(OffloadedGroup(critic, before_wake=(MODEL, *critic_optimizer)))
    return groups


class OffloadingEngineWeights:
    """`EngineWeights` of sleeping engines, with the training workers' state moved around them.

    Everything but `sleep` and `sync` is the wrapped `EngineWeights`'."""

    def __init__(self, weights: Any, groups: Sequence[OffloadedGroup], say: Callable[[str], None]) -> None:
        self.inner = weights
        self.groups = list(groups)
        self.say = say
        #: the last moves' figures (seconds, GiB; the policy's rank 0), for the step's metrics
        self.figures: dict[str, float] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _move(
        self, method: Callable[..., dict[str, float]], parts_of: Callable[[OffloadedGroup], tuple[str, ...]]
    ) -> float:
        started = time.perf_counter()
        gib = 0.0
        for entry in self.groups:
            parts = parts_of(entry)
            if parts:
                results = entry.group.call_all(method, parts)
                gib += sum(r.get("offloaded_gib", r.get("backloaded_gib", 0.0)) for r in results)
        self.figures[f"colocation/{method.__name__}_gib"] = gib
        return time.perf_counter() - started

    def offload_all(self) -> None:
        """Every group's offloaded parts to host memory (the engines are awake: before the first
        generation)."""
        seconds = self._move(RLWorker.offload_to_host, lambda e: (*e.before_wake, *e.after_push))
        self.say(
            f"colocation: the trainer's state waits in host memory while the engines are awake "
            f"({self.figures['colocation/offload_to_host_gib']:.2f} GiB moved in {seconds:.1f} s)"
        )

    def sleep(self) -> None:
        """The engines free their memory; the trainer's state comes back to the GPUs."""
        self.inner.sleep()
        self.figures["timing/backload_s"] = self._move(
            RLWorker.backload_to_device, lambda e: (*e.before_wake, *e.after_push)
        )

    def sync(self, policy_version: int) -> dict[str, float]:
        """Offload what the push does not read, wake the engines and push, then offload the
        policy's parameters; the push's figures and the moves' (this step's backload included)."""
        seconds = 0.0
        if self.inner.asleep:
            seconds += self._move(RLWorker.offload_to_host, lambda e: e.before_wake)
        pushed = self.inner.sync(policy_version)
        seconds += self._move(RLWorker.offload_to_host, lambda e: (*e.before_wake, *e.after_push))
        self.figures["timing/offload_s"] = seconds
        return {**pushed, **self.figures}


def colocated_weights(
    cfg: SkyliftConfig,
    weights: Any,
    policy: WorkerGroup,
    ref: WorkerGroup | None,
    critic: WorkerGroup | None,
    say: Callable[[str], None],
) -> OffloadingEngineWeights:
    """`weights` with the workers' state offloaded around the engines' waking hours; the state is
    moved to host memory now (the engines are awake)."""
    wrapped = OffloadingEngineWeights(weights, offloaded_groups(cfg, policy, ref, critic), say)
    wrapped.offload_all()
    return wrapped
