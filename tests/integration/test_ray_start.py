"""A run's Ray is chosen on purpose (issue 42, item 5): with a Ray already running on the machine
(`ray start --head --num-cpus 2`), a run without `RAY_ADDRESS` starts a local Ray of its own (it
used to join that one and crash: "When connecting to an existing cluster, num_cpus and num_gpus
must not be provided"); with `RAY_ADDRESS` it joins the cluster named there.

The other Ray lives in a temporary `RAY_TMPDIR` (so nobody else's Ray on this machine is seen or
touched) and in a process group of its own, which the test kills at the end: `ray stop` would stop
every Ray on the machine.

Run inside a loopback-only namespace: bash scripts/loopback.sh .venv/bin/pytest tests/integration
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import require_loopback_namespace

from skylift.cluster.ray_start import init_ray, ray_cluster_line

RAY = Path(sys.executable).with_name("ray")
#: The other Ray: what a user's `ray start --head --num-cpus 2` gives, on loopback, any free port.
HEAD_ARGS = (
    "start --head --num-cpus 2 --num-gpus 0 --include-dashboard=false --node-ip-address 127.0.0.1 "
    "--port 0 --disable-usage-stats"
)


@pytest.fixture()
def other_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """`ray start --head --num-cpus 2` in a temporary RAY_TMPDIR (this process sees it too, as a
    run on this machine would see /tmp/ray); yields its address."""
    require_loopback_namespace()
    # a short path: Ray's socket paths under it must stay within the 107 characters of AF_UNIX
    root = tempfile.mkdtemp(prefix="rayt", dir="/tmp")
    env = {**os.environ, "RAY_TMPDIR": root, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    process = subprocess.Popen(
        [str(RAY), *HEAD_ARGS.split()],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, out.decode(errors="replace")[-3000:]
        address = (Path(root) / "ray" / "ray_current_cluster").read_text().strip()
        monkeypatch.setenv("RAY_TMPDIR", root)
        monkeypatch.delenv("RAY_ADDRESS", raising=False)
        yield address
    finally:
        _kill_group(process.pid)
        shutil.rmtree(root, ignore_errors=True)


def _kill_group(pgid: int) -> None:
    """SIGTERM the `ray start` session's processes (GCS, raylet, ...), SIGKILL what is left after 2 s."""
    for sig, wait_s in ((signal.SIGTERM, 2.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.2)


def test_a_run_starts_its_own_ray_beside_a_running_one_and_joins_it_only_when_told(
    other_ray: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    assert init_ray(min_cpus=1, object_store_gb=0.1)
    try:
        ours = ray.get_runtime_context().gcs_address
        line = ray_cluster_line(joined=False)
        assert ours != other_ray and ray.cluster_resources()["CPU"] >= 2
        assert f"Ray cluster {ours} (started locally for this run; no RAY_ADDRESS" in line, line
    finally:
        ray.shutdown()

    monkeypatch.setenv("RAY_ADDRESS", other_ray)
    assert init_ray(min_cpus=64)  # a local Ray would get 64 CPUs; the joined cluster keeps its 2
    try:
        assert ray.get_runtime_context().gcs_address == other_ray
        assert ray.cluster_resources()["CPU"] == 2
        assert f"Ray cluster {other_ray} (joined): 1 node(s)" in ray_cluster_line(joined=True)
    finally:
        ray.shutdown()
