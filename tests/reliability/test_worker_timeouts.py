"""Calls to training workers never wait forever (issue 8, item 1): a rank that hangs, dies or
fails is reported at once, naming the worker, its rank and the call. Real Ray actors.

Run inside a loopback-only namespace: bash scripts/loopback.sh .venv/bin/pytest tests/reliability
"""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator

import pytest
from server_helpers import require_loopback_namespace

from skylift.cluster.ray_ranks import WorkerError, wait_for_ranks


class Rank:
    """A stand-in training rank: the behaviour under test is the waiting, not the work."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def pid(self) -> int:
        return os.getpid()

    def work(self, seconds: dict[int, float], fail_rank: int = -1) -> int:
        if self.rank == fail_rank:
            raise ValueError(f"rank {self.rank} cannot do this")
        time.sleep(seconds.get(self.rank, 0.0))
        return self.rank


@pytest.fixture(scope="module")
def ranks() -> Iterator[list]:
    require_loopback_namespace()
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            _node_ip_address="127.0.0.1",
            log_to_driver=False,
        )
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import test modules
    actor = ray.remote(num_cpus=0)(Rank)
    actors = [actor.remote(r) for r in range(3)]
    try:
        yield actors
    finally:
        for a in actors:
            ray.kill(a)
        if started:
            ray.shutdown()


def test_results_come_back_in_rank_order(ranks: list) -> None:
    refs = [a.work.remote({0: 0.3}) for a in ranks]
    assert wait_for_ranks(refs, "policy worker", "work", timeout_s=60) == [0, 1, 2]


def test_a_hanging_rank_is_named_after_the_timeout(ranks: list) -> None:
    started = time.monotonic()
    refs = [a.work.remote({1: 6.0}) for a in ranks]
    with pytest.raises(WorkerError, match=r"policy worker rank\(s\) \[1\]: work did not finish within 2 s"):
        wait_for_ranks(refs, "policy worker", "work", timeout_s=2)
    assert time.monotonic() - started < 10
    wait_for_ranks([a.work.remote({}) for a in ranks], "policy worker", "work", timeout_s=60)  # still usable


def test_a_failing_rank_fails_the_call_without_waiting_for_its_peers(ranks: list) -> None:
    started = time.monotonic()
    refs = [a.work.remote({0: 12.0, 1: 12.0}, fail_rank=2) for a in ranks]
    with pytest.raises(ValueError, match="rank 2 cannot do this"):
        wait_for_ranks(refs, "policy worker", "work", timeout_s=60)
    assert time.monotonic() - started < 8  # not the 12 s its peers are busy (e.g. in a collective)


def test_a_killed_rank_is_named(ranks: list) -> None:
    import ray

    victim = ranks[2]
    pid = ray.get(victim.pid.remote())
    refs = [a.work.remote({2: 30.0}) for a in ranks]
    time.sleep(0.5)
    os.kill(pid, signal.SIGKILL)
    with pytest.raises(WorkerError, match="ref worker rank 2: its process died during work"):
        wait_for_ranks(refs, "ref worker", "work", timeout_s=60)
