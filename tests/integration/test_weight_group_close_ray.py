"""With Ray placement (the default), the policy's rank 0 is a Ray actor, which runs its calls one
at a time. When an engine fails to join the weight-update group, the driver closes rank 0's side
while rank 0's `join_weight_group` still waits in the rendezvous; that close must reach the actor
beside the blocked join (its own concurrency group, `cluster.ray_ranks.WEIGHT_CONTROL`) and end
it, not queue behind it until `generator.weight_sync_timeout_s` (300 s by default) runs out.
Every other call stays serialized behind the join.

The ranks are real `RLWorker` actors of a real `WorkerGroup`; no model is loaded (the
weight-group calls need none). Run inside a loopback-only namespace (Ray and gloo listen on
every interface): bash scripts/loopback.sh .venv/bin/pytest tests/integration/test_weight_group_close_ray.py
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import pytest
from server_helpers import require_loopback_namespace

from skylift.cluster.worker_group import RLWorker, WorkerGroup
from skylift.weight_sync.process_group import WeightSyncError
from skylift.worker.training_worker import WorkerSettings

#: the group's rendezvous timeout, far past every bound below: a close that waited behind the
#: join would come back only after it, so the test fails instead of passing late
GROUP_TIMEOUT_S = 120.0
#: how long the driver may wait for each call below (a hang check, not a timing)
BOUND_S = 30.0


@pytest.fixture(scope="module")
def policy() -> Iterator[WorkerGroup]:
    require_loopback_namespace()
    import ray

    from skylift.cluster.ray_start import init_ray

    started = init_ray()
    group = WorkerGroup(
        "policy",
        WorkerSettings(model_path="no-model-is-loaded"),
        world_size=1,
        num_cpus_per_worker=0,
        timeout_s=GROUP_TIMEOUT_S + 30.0,  # the driver's own bound on a call stays past the group's
    )
    try:
        yield group
    finally:
        group.shutdown()  # closes rank 0's side, then kills the actors
        if started:
            ray.shutdown()


def test_closing_rank_0s_side_ends_its_join_in_flight_in_the_ray_actor(policy: WorkerGroup) -> None:
    address, port, backend = policy.host_weight_group(2, [], "gloo", GROUP_TIMEOUT_S, "127.0.0.1")
    assert (address, backend) == ("127.0.0.1", "gloo")
    calls = ThreadPoolExecutor(3)
    try:
        join = calls.submit(policy.join_weight_group)  # rank 1 (an engine's worker) never comes
        time.sleep(1.0)
        assert not join.done(), join.exception()
        # a default-group call still queues behind the join: rank 0's calls stay one at a time
        queued = calls.submit(policy.call_rank0, RLWorker.node_ip)
        time.sleep(1.0)
        assert not queued.done() and not join.done()

        started = time.monotonic()
        close = calls.submit(policy.close_weight_group)
        try:
            close.result(timeout=BOUND_S)
        except FutureTimeout:
            pytest.fail(f"close_weight_group did not return within {BOUND_S:.0f} s: it waits behind the join")
        with pytest.raises(
            WeightSyncError, match=f"rank 0 stopped waiting for the weight-update group at 127.0.0.1:{port}"
        ):
            join.result(timeout=BOUND_S)
        assert time.monotonic() - started < BOUND_S
        assert queued.result(timeout=BOUND_S) == "127.0.0.1"  # then the queued call ran
    finally:
        calls.shutdown(wait=False, cancel_futures=True)

    # rank 0 is usable again: it hosts a fresh group, and closing that (nothing waiting) is quiet
    assert policy.host_weight_group(2, [], "gloo", GROUP_TIMEOUT_S, "127.0.0.1")[0] == "127.0.0.1"
    policy.close_weight_group()
    with pytest.raises(WeightSyncError, match="no weight-update group on the policy's rank 0"):
        policy.join_weight_group()
