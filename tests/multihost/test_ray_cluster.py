"""A two-node Ray cluster (head on host A, a second node on host B) and `skylift train` joining it.

The placement keys decide where things run: each node offers 2 CPUs and every bundle asks for 2
(`trainer.placement.num_cpus_per_worker=2`), so the policy's group and the engine's cannot share
a node. The test reads the actors' nodes from Ray's state API while the run is set up, trains 2
GRPO steps with the logprob check after each sync, and finds no run process left (by PID).

The head runs the dashboard: the state API the test reads actor locations from is served by it.
Ray binds beyond loopback here, so it uses token authentication: every node and the driver get
`RAY_AUTH_MODE=token` and the same `RAY_AUTH_TOKEN`.
"""

from __future__ import annotations

import json
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hosts import Host, TwoHosts, wait_until

from skylift.data import write_arithmetic_dataset

RAY_PORT = 6390
RUN_PROCESS_MARKERS = (
    "ray::RLWorker",
    "ray::EngineActor",
    "VLLM",
    "EngineCore",
    "run_trainer.py",
    "run_fsdp.py",
)


@dataclass
class Cluster:
    address: str
    env: dict[str, dict[str, str]]  # per host name
    start_s: float


def _ray() -> str:
    return str(Path(sys.executable).parent / "ray")


@pytest.fixture(scope="module")
def cluster(two_hosts: TwoHosts) -> Iterator[Cluster]:
    token = secrets.token_hex(16)
    temp = tempfile.mkdtemp(prefix="/tmp/skmh-")  # short: Ray's socket paths must fit 107 bytes
    a, b = two_hosts.a, two_hosts.b
    address = f"{a.ip}:{RAY_PORT}"
    env = {
        h.name: two_hosts.env_for(
            h,
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN=token,
            RAY_USAGE_STATS_ENABLED="0",
            RAY_memory_monitor_refresh_ms="0",  # the machine is shared: its memory is not this cluster's
        )
        for h in (a, b)
    }
    common = ["--num-cpus=2", "--num-gpus=0", "--object-store-memory=150000000", f"--temp-dir={temp}"]
    started = time.perf_counter()
    try:
        _ray_start(a, ["--head", f"--node-ip-address={a.ip}", f"--port={RAY_PORT}", "--include-dashboard=true"],
                   common, env[a.name], Path(temp) / "head.log")  # fmt: skip
        _ray_start(
            b,
            [f"--address={address}", f"--node-ip-address={b.ip}"],
            common,
            env[b.name],
            Path(temp) / "node.log",
        )
        yield Cluster(address=address, env=env, start_s=time.perf_counter() - started)
    finally:
        for host in (b, a):
            host.kill_all(grace_s=10.0)
        shutil.rmtree(temp, ignore_errors=True)
        for host in (a, b):
            leftover = host.pids()
            assert not leftover, f"processes left on {host.name}:\n{host.describe(leftover)}"


def _ray_start(host: Host, args: list[str], common: list[str], env: dict[str, str], log: Path) -> None:
    """`ray start ...` in `host` (its daemons keep running; output to a file, not a pipe they hold)."""
    with open(log, "wb") as out:
        code = subprocess.run(host.cmd([_ray(), "start", *args, *common]), stdout=out, stderr=subprocess.STDOUT,
                              env=env, timeout=180).returncode  # fmt: skip
    assert code == 0, f"ray start on {host.name} failed:\n{log.read_text(errors='replace')[-3000:]}"


def _run_processes(two_hosts: TwoHosts) -> str:
    """The run's own processes (workers, engines, the driver) still alive on either host."""
    found = []
    for host in (two_hosts.a, two_hosts.b):
        described = host.describe(host.pids())
        found += [line for line in described.splitlines() if any(m in line for m in RUN_PROCESS_MARKERS)]
    return "\n".join(found)


# Alone, before the halves (scripts/test_halves.sh): two Ray nodes with an engine and a policy
# beside the other half's two-engine runs went past the machine's 24 GB (the kernel's OOM killer
# took an engine or a policy worker, twice in session 18's full runs).
@pytest.mark.whole_machine
def test_engines_and_policy_on_different_nodes(
    two_hosts: TwoHosts, cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    write_arithmetic_dataset(data, num_train=8, num_val=4, seed=0)
    overrides = {
        "trainer.policy.model.path": str(tiny_model_dir),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": f"['{data / 'validation.parquet'}']",
        "environment.env_class": "arithmetic",
        "trainer.placement.backend": "ray",
        "trainer.placement.num_cpus_per_worker": 2,
        "trainer.placement.timeout_s": 60,
        "generator.num_inference_engines": 1,
        "generator.http_timeout_s": 60,
        "generator.weight_sync_timeout_s": 60,
        # the two simulated hosts share one kernel (one boot id, one /dev/shm), so `auto` rightly
        # shares memory between them; this test is about a group over the network between nodes
        "generator.weight_sync_backend": "gloo",
        "generator.engine_startup_timeout_s": 400,
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 16,
        "trainer.max_prompt_length": 128,
        "trainer.max_steps": 2,
        "trainer.eval_before_train": False,
        "trainer.eval_interval": 2,
        "trainer.eval_batch_size": 4,
        "trainer.ckpt_interval": -1,
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.skip_zero_advantage_rows": False,
        "trainer.ckpt_path": str(tmp_path / "ckpts"),
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
        "trainer.logger": "jsonl",
    }
    report_path = tmp_path / "report.json"
    runner = Path(__file__).with_name("run_trainer.py")
    cmd = [sys.executable, str(runner), str(report_path), *(f"{k}={v}" for k, v in overrides.items())]
    log = tmp_path / "driver.log"
    env = {**cluster.env[two_hosts.a.name], "RAY_ADDRESS": cluster.address}
    process = two_hosts.a.popen(cmd, log, env)
    try:
        code = process.wait(timeout=600)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the run did not finish:\n{log.read_text(errors='replace')[-4000:]}")
    text = log.read_text(errors="replace")
    assert report_path.is_file(), text[-4000:]
    report = json.loads(report_path.read_text())
    assert code == 0 and report["error"] is None, (report["error"], text[-4000:])
    # the first lines say which cluster was joined and what it has
    assert f"Ray cluster {cluster.address} (joined): 2 node(s)" in text, text[:3000]
    nodes = {a["class"]: a["node_ip"] for a in report["actors"] if a["class"] in ("RLWorker", "EngineActor")}
    assert set(nodes) == {"RLWorker", "EngineActor"}, report["actors"]
    assert {nodes["RLWorker"], nodes["EngineActor"]} == {two_hosts.a.ip, two_hosts.b.ip}, nodes
    # the weight-update group listens on the policy's node IP, which the engine's node reaches
    assert f"engine(s) dial {nodes['RLWorker']}" in text
    steps = [h for h in report["history"] if "reward/mean" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for h in steps:
        assert h["policy/logprob_diff_vs_rollout"] < 1e-3, h
    assert any("eval/accuracy" in h for h in report["history"])
    print(
        f"cluster start {cluster.start_s:.1f} s; run set-up {report['setup_s']:.1f} s; policy on "
        f"{nodes['RLWorker']}, engine on {nodes['EngineActor']}; weight sync (s): "
        f"{[round(h['timing/weight_sync_s'], 3) for h in steps]}"
    )
    # the run's processes are gone (the cluster's own daemons stay until the fixture stops them)
    wait_until(lambda: not _run_processes(two_hosts), 30, f"run processes exit:\n{_run_processes(two_hosts)}")


def test_fsdp_policy_ranks_on_two_nodes_meet_at_rank0_node_ip(
    two_hosts: TwoHosts, cluster: Cluster, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """`policy_num_nodes=2`: one rank per host; the group's MASTER_ADDR is rank 0's node IP."""
    report_path = tmp_path / "fsdp.json"
    runner = Path(__file__).with_name("run_fsdp.py")
    log = tmp_path / "fsdp.log"
    env = {**cluster.env[two_hosts.a.name], "RAY_ADDRESS": cluster.address}
    process = two_hosts.a.popen(
        [sys.executable, str(runner), str(report_path), str(tiny_model_dir)], log, env
    )
    try:
        code = process.wait(timeout=300)
    except subprocess.TimeoutExpired:
        process.kill()
        pytest.fail(f"the FSDP run did not finish:\n{log.read_text(errors='replace')[-4000:]}")
    text = log.read_text(errors="replace")
    assert report_path.is_file(), text[-4000:]
    report = json.loads(report_path.read_text())
    assert code == 0 and report["error"] is None, (report["error"], text[-4000:])
    assert sorted(report["node_ips"]) == [two_hosts.a.ip, two_hosts.b.ip]
    assert report["init_method"].startswith(f"tcp://{report['node_ips'][0]}:")
    assert report["max_abs_diff"] < 1e-5
    wait_until(lambda: not _run_processes(two_hosts), 30, "FSDP run processes exit")
