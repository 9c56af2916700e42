"""Fair sharing and per-user quotas of the Tinker server (skylift.tinker.core.fairness): one user's
flood of requests does not starve another user of the training thread or a sampling engine, a
wait has a bound with a clear error, and each user's futures, snapshots, stability records and
checkpoint disk have their own share. Fake work only; orders are asserted, never timings."""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from skylift.tinker.core.auth import current_user
from skylift.tinker.core.fairness import BusyError, FairGate, QuotaError


def as_user(user: str, coro_fn: Callable[[], Any]) -> asyncio.Task[Any]:
    """A task running `coro_fn()` as `user` (the request context the auth middleware sets)."""
    ctx = contextvars.copy_context()
    ctx.run(current_user.set, user)
    return asyncio.get_running_loop().create_task(coro_fn(), context=ctx)


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_a_flooding_user_does_not_starve_another_on_a_one_slot_gate() -> None:
    async def go() -> list[str]:
        gate = FairGate(1, None, "the training thread", "--fair-wait-timeout-s")
        order: list[str] = []
        release = asyncio.Event()

        async def hold(user: str) -> None:
            async with gate.slot(user):
                order.append(user)
                await release.wait()

        first = asyncio.create_task(hold("alice"))
        await settle()
        flood = [asyncio.create_task(hold("alice")) for _ in range(20)]
        await settle()
        bob = asyncio.create_task(hold("bob"))
        await settle()
        assert gate.waiting_of("alice") == 20 and gate.waiting_of("bob") == 1
        release.set()
        await asyncio.gather(first, *flood, bob)
        return order

    order = asyncio.run(go())
    assert len(order) == 22
    # bob's one request runs right after alice's next one, not after her 20 queued ones
    assert order[:4] == ["alice", "alice", "bob", "alice"], order
    assert order.index("bob") == 2


def test_round_robin_across_three_users_with_two_slots() -> None:
    async def go() -> list[str]:
        gate = FairGate(2, None, "the sampling engine", "--fair-wait-timeout-s")
        order: list[str] = []
        gates = {u: asyncio.Event() for u in ("hold",)}

        async def run(user: str, wait: bool = False) -> None:
            async with gate.slot(user):
                order.append(user)
                if wait:
                    await gates["hold"].wait()
                await asyncio.sleep(0)

        holders = [asyncio.create_task(run("a", wait=True)) for _ in range(2)]
        await settle()
        tasks = [asyncio.create_task(run("a")) for _ in range(10)]
        await settle()
        tasks += [asyncio.create_task(run(u)) for u in ("b", "c", "b", "c")]
        await settle()
        gates["hold"].set()
        await asyncio.gather(*holders, *tasks)
        return order

    order = asyncio.run(go())
    after = order[2:]
    # while all three wait, each round serves each of them once
    assert after[:6] == ["a", "b", "c", "a", "b", "c"], after
    assert sorted(order) == sorted(["a"] * 12 + ["b", "b", "c", "c"])


def test_with_a_per_user_share_a_flood_leaves_a_slot_for_another_user() -> None:
    async def go() -> tuple[list[str], list[str], int]:
        gate = FairGate(4, None, "the sampling engine", "--fair-wait-timeout-s", per_user=3)
        started: list[str] = []
        release = asyncio.Event()

        async def run(user: str) -> None:
            async with gate.slot(user):
                started.append(user)
                await release.wait()

        flood = [asyncio.create_task(run("a")) for _ in range(8)]
        await settle()
        alone = list(started)  # the flooding user alone: three at once, one slot left free
        b = asyncio.create_task(run("b"))
        await settle()
        with_b = list(started)  # b starts at once, without waiting for any of a's to end
        waiting = gate.waiting
        release.set()
        await asyncio.gather(*flood, b)
        return alone, with_b, waiting

    alone, with_b, waiting = asyncio.run(go())
    assert alone == ["a"] * 3
    assert with_b == ["a", "a", "a", "b"] and waiting == 5


def test_a_per_user_share_still_serves_every_request_in_turn() -> None:
    async def go() -> list[str]:
        gate = FairGate(2, None, "the sampling engine", "--fair-wait-timeout-s", per_user=1)
        order: list[str] = []

        async def run(user: str) -> None:
            async with gate.slot(user):
                order.append(user)
                await asyncio.sleep(0)

        tasks = [asyncio.create_task(run(u)) for u in "aaabb"]
        await asyncio.gather(*tasks)
        assert gate.waiting == 0 and not gate._held
        return order

    order = asyncio.run(go())
    assert sorted(order) == sorted("aaabb") and order[:2] == ["a", "b"]


def test_a_wait_past_the_timeout_is_a_clear_busy_error_and_leaves_the_gate_usable() -> None:
    async def go() -> tuple[str, int]:
        gate = FairGate(1, 0.01, "the training thread", "--fair-wait-timeout-s")
        release = asyncio.Event()

        async def hold() -> None:
            async with gate.slot("alice"):
                await release.wait()

        holder = asyncio.create_task(hold())
        await settle()
        with pytest.raises(BusyError) as info:
            async with gate.slot("bob"):
                pass
        waiting = gate.waiting
        release.set()
        await holder
        async with gate.slot("bob"):  # free again: no slot leaked by the timed-out wait
            pass
        return str(info.value), waiting

    message, waiting = asyncio.run(go())
    assert "the training thread" in message and "--fair-wait-timeout-s" in message, message
    assert waiting == 0


def test_a_cancelled_waiter_leaves_the_queue() -> None:
    async def go() -> int:
        gate = FairGate(1, None, "x", "--y")
        release = asyncio.Event()

        async def hold(user: str) -> None:
            async with gate.slot(user):
                await release.wait()

        holder = asyncio.create_task(hold("a"))
        await settle()
        waiter = asyncio.create_task(hold("b"))
        await settle()
        waiter.cancel()
        await settle()
        left = gate.waiting
        release.set()
        await holder
        async with gate.slot("c"):
            pass
        return left

    assert asyncio.run(go()) == 0


def test_the_training_thread_takes_users_in_turn(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The real service's training thread (one executor thread behind a one-slot gate)."""
    from skylift.tinker.service import ServerConfig, TinkerService

    config = ServerConfig(
        base_models=[str(tiny_model_dir)], db_url=f"sqlite:///{tmp_path / 't.db'}", data_dir=tmp_path / "d"
    )
    service = TinkerService(config)
    order: list[str] = []

    async def go() -> None:
        started = asyncio.Event()
        release = asyncio.Event()
        loop = asyncio.get_running_loop()

        def blocking(user: str) -> None:
            loop.call_soon_threadsafe(started.set)
            asyncio.run_coroutine_threadsafe(release.wait(), loop).result()
            order.append(user)

        first = as_user("alice", lambda: service.requests.run_training(blocking, "alice"))
        await started.wait()
        flood = [
            as_user("alice", lambda: service.requests.run_training(order.append, "alice")) for _ in range(10)
        ]
        await settle()
        bob = as_user("bob", lambda: service.requests.run_training(order.append, "bob"))
        await settle()
        release.set()
        await asyncio.gather(first, *flood, bob)

    try:
        asyncio.run(go())
    finally:
        service.requests._executor.shutdown(wait=False)
        service.store.close()
    assert order.index("bob") == 2, order
    assert service.sampling.gate_slots == config.sampling_slots


def test_outstanding_futures_have_a_per_user_quota(tmp_path: Path) -> None:
    from skylift.tinker.core.futures import FutureHub
    from skylift.tinker.storage.store import Store

    store = Store(f"sqlite:///{tmp_path / 'f.db'}")

    async def go() -> str:
        hub = FutureHub(store, max_pending_per_user=3)

        async def submit(user: str) -> str:
            token = current_user.set(user)
            try:
                request_id, _ = hub.submit("sample", None)
                await hub.persisted(request_id)
                return request_id
            finally:
                current_user.reset(token)

        alice = [await submit("alice") for _ in range(3)]
        with pytest.raises(QuotaError) as info:
            await submit("alice")
        await submit("bob")  # another user is not affected

        async def value() -> dict[str, Any]:
            return {}

        await hub.execute(alice[0], value)  # one of alice's finishes: she may send one more
        await submit("alice")
        with pytest.raises(QuotaError):
            await submit("alice")
        await hub.close()
        return str(info.value)

    message = asyncio.run(go())
    store.close()
    assert "3 requests pending" in message and "--max-pending-per-user" in message, message


def test_snapshots_have_a_per_user_quota() -> None:
    from skylift.tinker.sampling.snapshots import SnapshotStore

    weights = {"w": torch.zeros(4)}  # 16 bytes
    store = SnapshotStore(max_bytes=1 << 30, max_idle=4, max_held_bytes_per_user=32)
    token = current_user.set("alice")
    try:
        store.add("ephemeral:a1", "sa", weights)
        store.add("ephemeral:a2", "sa", weights)
        store.add("ephemeral:a2", "sa", weights)  # replacing one of hers is no new snapshot
        with pytest.raises(QuotaError, match="--max-snapshot-mb-per-user"):
            store.add("ephemeral:a3", "sa", weights)
    finally:
        current_user.reset(token)
    token = current_user.set("bob")
    try:
        store.add("ephemeral:b1", "sb", weights)
    finally:
        current_user.reset(token)
    store.release_session("sa")  # her finished session's snapshots no longer count
    token = current_user.set("alice")
    try:
        store.add("ephemeral:a3", "sa2", weights)
    finally:
        current_user.reset(token)
    assert store.get("ephemeral:b1") is not None


def test_stability_records_have_a_per_user_share() -> None:
    from skylift.tinker.core.provenance import StabilityRecords

    records = StabilityRecords(max_tokens=1000, max_tokens_per_user=10)
    token = current_user.set("bob")
    try:
        records.add("bob:0", "sb", [1, 2, 3], [-0.1, -0.2, -0.3])
    finally:
        current_user.reset(token)
    token = current_user.set("alice")
    try:
        for i in range(20):  # a flood of alice's samples drops only her own oldest records
            records.add(f"alice:{i}", "sa", [1, 2, 3, 4], [-0.1] * 4)
    finally:
        current_user.reset(token)
    assert records.get("bob:0", "sb").tokens.tolist() == [1, 2, 3]
    assert records.tokens_of("alice") <= 10 and records.tokens_of("bob") == 3
    assert records.get("alice:19", "sa") is not None
    with pytest.raises(Exception, match="no stability record"):
        records.get("alice:0", "sa")


def test_checkpoint_disk_has_a_per_user_quota() -> None:
    from skylift.tinker.checkpoints.operations import CheckpointOperations

    rows = {"alice": [SimpleNamespace(size_bytes=600 * 1024**2)] * 2, "bob": []}
    store = SimpleNamespace(checkpoints=lambda owner=None: rows[owner])
    ops = CheckpointOperations(store, None, None, 1.0)  # type: ignore[arg-type]
    with pytest.raises(QuotaError, match="--max-checkpoint-gb-per-user"):
        ops.check_disk_quota("alice", 0)
    ops.check_disk_quota("bob", 0)
    with pytest.raises(QuotaError):
        ops.check_disk_quota("bob", 2 * 1024**3)  # a copy larger than the share


def test_an_exhausted_quota_is_a_429_over_http(tmp_path: Path, tiny_model_dir: Path) -> None:
    from skylift.tinker.app import create_app
    from skylift.tinker.service import ServerConfig

    config = ServerConfig(
        base_models=[str(tiny_model_dir)],
        db_url=f"sqlite:///{tmp_path / 'q.db'}",
        data_dir=tmp_path / "data",
        max_pending_per_user=0,
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        headers = {"X-API-Key": "tml-x"}
        sid = client.post("/api/v1/create_session", json={"tags": []}, headers=headers).json()["session_id"]
        body = {"session_id": sid, "model_seq_id": 0, "base_model": str(tiny_model_dir)}
        resp = client.post("/api/v1/create_model", json=body, headers=headers)
        assert resp.status_code == 429 and "--max-pending-per-user" in resp.json()["error"], resp.text
        resp = client.post("/api/v1/optim_step", json={"model_id": "nope", "seq_id": "x"}, headers=headers)
        assert resp.status_code == 429, resp.text
        assert client.get("/api/v1/healthz").json() == {"status": "ok"}
