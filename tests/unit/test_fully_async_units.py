"""Fully async training without vLLM: admission control, the buffer, staleness, token versions,
the generation workers on their loop thread, and the configuration checks."""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

import pytest

from skylift.config import ConfigError, load_config
from skylift.generator import Trajectory
from skylift.generator.generator import join_completions
from skylift.inference.types import Completion
from skylift.inference.vllm_io import token_versions
from skylift.rl.fully_async import (
    FullyAsyncRollouts,
    Group,
    PromptSource,
    StalenessGate,
    take_fresh,
    token_version_metrics,
)
from skylift.utils.loop_thread import LoopThread


def _trajectory(version: int, tokens: list[int] | None = None, uid: str = "p") -> Trajectory:
    labels = tokens if tokens is not None else [version, version]
    return Trajectory(
        uid=uid,
        prompt_ids=[1],
        response_ids=[7] * len(labels),
        loss_mask=[1] * len(labels),
        rollout_logprobs=[-1.0] * len(labels),
        reward=0.0,
        stop_reason="stop",
        policy_version=min(labels) if labels else version,
        token_versions=labels,
    )


def _group(version: int, finished_at: float, row: str = "r") -> Group:
    return Group([_trajectory(version)], row=row, step=0, finished_at=finished_at)


# ---------------------------------------------------------------- admission
def test_gate_admits_one_batch_per_version_ahead_and_reuses_dropped_slots() -> None:
    gate = StalenessGate(batch_size=4, max_staleness=2, max_in_flight=100)
    assert gate.capacity(0) == 12
    for _ in range(12):
        assert gate.may_start(0)
        gate.start()
    assert not gate.may_start(0)  # a 13th group could be trained 3 versions after it started
    assert gate.may_start(1)  # one update later, one more batch
    gate.drop(2)
    assert gate.capacity(0) == 14


def test_gate_bounds_groups_in_flight_and_starts_from_a_resumed_version() -> None:
    gate = StalenessGate(batch_size=2, max_staleness=0, max_in_flight=1, base_version=7)
    assert gate.capacity(7) == 2  # a resumed run at version 7 still starts one batch only
    gate.start()
    assert not gate.may_start(7)  # one worker
    gate.finish()
    assert gate.may_start(7)


# ---------------------------------------------------------------- the buffer
def test_take_fresh_drops_too_stale_groups_and_takes_the_oldest_first() -> None:
    buffer = [_group(3, 0.1), _group(5, 0.2), _group(4, 0.3), _group(5, 0.05), _group(1, 0.0)]
    taken, dropped, kept = take_fresh(buffer, policy_version=5, max_staleness=2, batch_size=2)
    assert [g.version for g in dropped] == [1]
    assert [(g.version, g.finished_at) for g in taken] == [(3, 0.1), (4, 0.3)]
    assert [(g.version, g.finished_at) for g in kept] == [(5, 0.2), (5, 0.05)]


def test_take_fresh_takes_nothing_until_a_batch_is_ready() -> None:
    taken, dropped, kept = take_fresh([_group(0, 0.0)], policy_version=0, max_staleness=1, batch_size=2)
    assert taken == [] and dropped == [] and len(kept) == 1


def test_token_version_metrics_count_versions_and_spanning_samples() -> None:
    batch = [_trajectory(0, [0, 0, 1, 1]), _trajectory(1, [1, 1])]
    metrics = token_version_metrics(batch, policy_version=2)
    assert metrics["fully_async/versions_in_batch"] == 2
    assert metrics["fully_async/samples_spanning_versions"] == 1
    assert metrics["fully_async/token_staleness_max"] == 2
    assert metrics["fully_async/token_staleness_mean"] == pytest.approx((2 + 2 + 1 + 1 + 1 + 1) / 6)


# ---------------------------------------------------------------- token versions from the engine
@dataclass
class _Span:
    version: str
    start: int
    end: int


def test_vllm_weight_version_spans_become_per_token_versions() -> None:
    assert token_versions([_Span("3", 0, 2), _Span("4", 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert token_versions([_Span("default", 0, 2)], 2) is None  # never labelled
    assert token_versions(None, 3) is None
    assert token_versions([_Span("1", 0, 2)], 3) is None  # spans must cover every token


def test_a_resubmitted_sample_keeps_its_tokens_logprobs_and_versions() -> None:
    first = Completion([5, 6], [-0.1, -0.2], "abort", token_versions=[2, 2])
    rest = Completion([7], [-0.3], "length", matched_stop=None, token_versions=[3])
    joined = join_completions(first, rest)
    assert joined.token_ids == [5, 6, 7] and joined.logprobs == [-0.1, -0.2, -0.3]
    assert joined.token_versions == [2, 2, 3] and joined.stop_reason == "length"
    unlabelled = join_completions(first, Completion([7], None, "stop"))
    assert unlabelled.token_versions is None and unlabelled.logprobs is None


# ---------------------------------------------------------------- the workers on their loop thread
class _Run:
    """A simulated run: the generation workers' groups take a random while; the 'trainer' takes
    batches and bumps the engines' version after each, as the RL loop does after its sync."""

    def __init__(self, seed: int) -> None:
        self.version = 0
        self.rng = random.Random(seed)
        self.started_at: list[int] = []

    async def group(self, row: Any, step: int, version: int) -> list[Trajectory]:
        self.started_at.append(version)
        await asyncio.sleep(self.rng.uniform(0.0, 0.01))
        return [_trajectory(version, uid=str(row)) for _ in range(2)]


@pytest.mark.parametrize("bound", [0, 2])
def test_workers_fill_a_bounded_buffer_and_batches_stay_within_the_bound(bound: int) -> None:
    run, batch, steps = _Run(seed=bound), 3, 6
    loop = LoopThread(asyncio.new_event_loop())
    rows = iter([(f"row{i}", i // batch) for i in range(batch * steps * 2)])
    stream = FullyAsyncRollouts(
        loop,
        PromptSource(rows),
        run.group,
        lambda: run.version,
        batch_size=batch,
        max_staleness=bound,
        workers=batch * (bound + 1),
        timeout_s=30,
    )
    try:
        for step in range(steps):
            groups, metrics = stream.take(step)
            assert all(g.completion_s is not None and g.completion_s >= 0 for g in groups)
            trajectories = [tr for g in groups for tr in g.trajectories]
            assert len({tr.uid for tr in trajectories}) == batch
            assert all(0 <= step - tr.policy_version <= bound for tr in trajectories)
            assert metrics["fully_async/token_staleness_max"] <= bound
            # bounded: never more groups started than one batch per version ahead
            assert stream.gate.started <= (run.version + bound + 1) * batch + stream.gate.dropped
            run.version += 1
            stream.notify_version()
    finally:
        stream.close()
        loop.stop()
    if bound == 0:  # synchronous in effect: every batch sampled by the weights it trains
        assert all(v <= steps for v in run.started_at)


def test_a_generation_error_reaches_the_trainer() -> None:
    async def failing(row: Any, step: int, version: int) -> list[Trajectory]:
        raise ValueError("engine said no")

    loop = LoopThread(asyncio.new_event_loop())
    stream = FullyAsyncRollouts(
        loop,
        PromptSource(iter([("a", 0), ("b", 0)])),
        failing,
        lambda: 0,
        batch_size=2,
        max_staleness=1,
        workers=2,
        timeout_s=10,
    )
    try:
        with pytest.raises(ValueError, match="engine said no"):
            stream.take(0)
    finally:
        stream.close()
        loop.stop()


def test_running_out_of_data_is_an_error_naming_the_batch() -> None:
    async def group(row: Any, step: int, version: int) -> list[Trajectory]:
        return [_trajectory(version, uid=str(row))]

    loop = LoopThread(asyncio.new_event_loop())
    stream = FullyAsyncRollouts(
        loop,
        PromptSource(iter([("a", 0)])),
        group,
        lambda: 0,
        batch_size=2,
        max_staleness=1,
        workers=2,
        timeout_s=10,
    )
    try:
        with pytest.raises(RuntimeError, match="data ran out with 1 of 2"):
            stream.take(0)
    finally:
        stream.close()
        loop.stop()


# ---------------------------------------------------------------- configuration
FULLY_ASYNC = [
    "trainer.fully_async.enabled=true",
    "trainer.algorithm.use_tis=true",
    "trainer.algorithm.tis_imp_ratio_cap=2.0",
]


def test_fully_async_config_defaults_and_checks() -> None:
    cfg = load_config(FULLY_ASYNC)
    fa = cfg.trainer.fully_async
    assert (fa.max_staleness_steps, fa.num_parallel_generation_workers, fa.pause_mode) == (4, None, "keep")
    with pytest.raises(ConfigError, match="use_tis=true"):
        load_config(["trainer.fully_async.enabled=true"])
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_config([*FULLY_ASYNC, "trainer.async_training=true"])
    with pytest.raises(ConfigError, match=r"num_parallel_generation_workers=41 must be in .* = \[8, 40\]"):
        load_config([*FULLY_ASYNC, "trainer.fully_async.num_parallel_generation_workers=41"])
    with pytest.raises(ConfigError, match="pause_mode='wait' is not one of keep, abort"):
        load_config([*FULLY_ASYNC, "trainer.fully_async.pause_mode=wait"])
    load_config(["trainer.fully_async.num_parallel_generation_workers=41"])  # checked only when enabled
