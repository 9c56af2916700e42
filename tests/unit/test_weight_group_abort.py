"""A weight-update group that fails to form leaves nothing waiting: the trainer's rank 0, blocked
in the group's rendezvous for engines that will never come, is ended when its side is closed
(`WeightBroadcaster.close` stops hosting the store), so the failure is prompt and the process
exits at once instead of sitting out `generator.weight_sync_timeout_s` (300 s by default) at
interpreter exit, where Python joins the thread still blocked in torch's gloo rendezvous."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from server_helpers import require_loopback_namespace

from skylift.weight_sync.broadcast.broadcaster import WeightBroadcaster
from skylift.weight_sync.process_group import WeightSyncError

#: far longer than either bound below: a rendezvous left waiting shows as a timeout, not a pass
GROUP_TIMEOUT_S = 120.0


def test_a_dead_engine_at_the_handshake_fails_fast_and_the_trainer_process_exits() -> None:
    require_loopback_namespace()  # gloo listens on every interface
    peer = Path(__file__).with_name("weight_group_peer.py")
    start = time.monotonic()
    try:  # a hang check, not a timing: a rank 0 left waiting keeps the process for 120 s
        done = subprocess.run(
            [sys.executable, str(peer), str(GROUP_TIMEOUT_S)], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the trainer process did not exit within 60 s of starting: {exc.stderr!r:.2000}")
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["failed_after_s"] < 30, report
    # the error names both ends: the group rank 0 hosts, and the engine that failed
    assert "did not form between rank 0 (hosting it at 127.0.0.1:" in report["error"], report
    assert "engine 0 (DyingEngine(engine-0)): init_weight_update_communicator failed" in report["error"]
    assert "EngineDeadError" in report["error"]
    # rank 0 was in the rendezvous, and closing its side ended it
    assert report["rank0"].startswith("rank 0 stopped waiting for the weight-update group at 127.0.0.1:")
    assert time.monotonic() - start < 60


def test_closing_the_broadcaster_ends_a_rendezvous_in_flight() -> None:
    require_loopback_namespace()
    broadcaster = WeightBroadcaster(timeout_s=GROUP_TIMEOUT_S)
    port = broadcaster.host("127.0.0.1", world_size=2, backend="gloo", group_name="abandoned")
    outcome: list[BaseException | None] = []

    def join() -> None:
        try:
            broadcaster.join()
            outcome.append(None)
        except BaseException as exc:  # noqa: BLE001 - checked below
            outcome.append(exc)

    waiter = threading.Thread(target=join, daemon=True)
    waiter.start()
    waiter.join(1.0)  # rank 0 waits for rank 1, which never comes
    assert waiter.is_alive()
    broadcaster.close()
    waiter.join(30.0)
    assert not waiter.is_alive(), "closing the broadcaster left its rendezvous waiting"
    assert isinstance(outcome[0], WeightSyncError)
    assert f"stopped waiting for the weight-update group at 127.0.0.1:{port}" in str(outcome[0])
    assert broadcaster.group is None
    with pytest.raises(WeightSyncError, match="call host\\(\\) first"):
        broadcaster.join()
