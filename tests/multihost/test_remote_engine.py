"""The seed's remote layout across two hosts: `skylift serve` on host B, `skylift train` on host A.

One server on B (tiny model, API key) serves both tests:
1. two GRPO steps with evaluation: the weight-update group's store listens on A's address on the
   veth link (not 127.0.0.1), and after each sync the engine's logprobs of the sampled tokens
   match the trainer's (|lp diff| < 1e-3);
2. the link cut during a step: the run notices within its timeouts, names host B, stops with a
   checkpoint (exit code 3) and leaves no process behind; with the link back, the same command
   (`resume_mode=latest`) continues from that checkpoint to the end.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from hosts import Host, TwoHosts, wait_until
from server_helpers import tiny_server_args

from skylift.data import write_arithmetic_dataset

API_KEY = "multihost-key"
PORT = 8001
#: Short timeouts for the cut link (noticed within seconds, not the defaults' minutes), with room
#: for a loaded 2-core machine; the run without faults gets more.
HTTP_TIMEOUT_S = 45
SYNC_TIMEOUT_S = 30
CALM_TIMEOUT_S = 180


@dataclass
class Server:
    url: str  # host:port as seen from host A
    process: subprocess.Popen
    log: Path


def _warm_up(url: str) -> None:
    """One completion, so that the first training step does not pay the engine's warm-up."""
    body = json.dumps({"model": "tiny-qwen2", "prompt": "1 + 1 =", "max_tokens": 8}).encode()
    req = urllib.request.Request(
        f"http://{url}/v1/completions",
        data=body,
        headers={"Content-Type": "application/json", "Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.status == 200


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"http://{url}/health", timeout=3) as resp:
            return resp.status == 200
    except OSError:
        return False


def _serving(two_hosts: TwoHosts, host: Host, name: str, model: Path, log: Path) -> Iterator[Server]:
    """A `skylift serve` on `host`, healthy and warmed up as seen from host A (across the link for
    B); the caller ends it."""
    cmd = [sys.executable, "-m", "skylift.inference.server", "--model", str(model)]
    cmd += ["--host", host.ip, "--port", str(PORT), "--api-key", API_KEY, *tiny_server_args()]
    process = host.popen(cmd, log, two_hosts.env_for(host))
    server = Server(url=f"{host.ip}:{PORT}", process=process, log=log)
    deadline = time.monotonic() + 420
    while not two_hosts.a.call(_healthy, server.url):
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"server on host {name} did not come up:\n{log.read_text()[-3000:]}")
        time.sleep(1.0)
    two_hosts.a.call(_warm_up, server.url)
    yield server


@pytest.fixture(scope="module")
def server_b(
    two_hosts: TwoHosts, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    b = two_hosts.b
    try:
        yield from _serving(
            two_hosts, b, "B", tiny_model_dir, tmp_path_factory.mktemp("server-b") / "server.log"
        )
    finally:
        b.kill_all(grace_s=20.0)
        leftover = b.pids()
        assert not leftover, f"processes left on host B:\n{b.describe(leftover)}"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("arith")
    write_arithmetic_dataset(out, num_train=16, num_val=4, seed=0)
    return out


def _overrides(data: Path, run: Path, model: Path, server: Server, **extra: object) -> list[str]:
    base: dict[str, object] = {
        "trainer.policy.model.path": str(model),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": f"['{data / 'validation.parquet'}']",
        "environment.env_class": "arithmetic",
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{server.url}']",
        "generator.http_timeout_s": HTTP_TIMEOUT_S,
        "generator.weight_sync_timeout_s": SYNC_TIMEOUT_S,
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 4,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 16,
        "trainer.max_prompt_length": 128,
        "trainer.eval_batch_size": 4,
        "trainer.eval_before_train": False,
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.skip_zero_advantage_rows": False,
        "trainer.ckpt_path": str(run / "ckpts"),
        "trainer.export_path": str(run / "exports"),
        "trainer.log_dir": str(run / "logs"),
        "trainer.logger": "jsonl",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _train(two_hosts: TwoHosts, overrides: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "skylift.entrypoints.main_base", *overrides]
    return two_hosts.a.popen(cmd, log, two_hosts.env_for(two_hosts.a, SKYLIFT_API_KEY=API_KEY))


def _train_to_the_end(two_hosts: TwoHosts, overrides: list[str], log: Path) -> str:
    """A run that must end well within 300 s, exit 0; its log."""
    process = _train(two_hosts, overrides, log)
    try:
        code = process.wait(timeout=300)
    finally:
        if process.poll() is None:
            two_hosts.a.kill_all()
    text = log.read_text(errors="replace")
    assert code == 0, text[-4000:]
    return text


def _metrics(run: Path) -> list[dict]:
    path = run / "logs" / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _assert_nothing_left(two_hosts: TwoHosts) -> None:
    leftover = two_hosts.a.pids()
    assert not leftover, f"processes left on host A:\n{two_hosts.a.describe(leftover)}"


def test_two_steps_across_hosts_sync_and_evaluate(
    two_hosts: TwoHosts, server_b: Server, data: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    overrides = _overrides(
        data,
        tmp_path,
        tiny_model_dir,
        server_b,
        **{
            "trainer.max_steps": 2,
            "trainer.eval_interval": 2,
            "generator.http_timeout_s": CALM_TIMEOUT_S,
            "generator.weight_sync_timeout_s": CALM_TIMEOUT_S,
        },
    )
    text = _train_to_the_end(two_hosts, overrides, tmp_path / "train.log")
    # the store listens on A's address on the link, which B can reach
    assert f"engine(s) dial {two_hosts.a.ip}" in text, text[-4000:]
    steps = [m for m in _metrics(tmp_path) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:  # after each sync the engine samples with the trainer's weights
        assert m["policy/logprob_diff_vs_rollout"] < 1e-3, m
        assert m["timing/weight_sync_s"] > 0
    assert any("eval/accuracy" in m for m in _metrics(tmp_path))
    print("weight sync across the link (s):", [round(m["timing/weight_sync_s"], 3) for m in steps])
    _assert_nothing_left(two_hosts)


def test_link_cut_during_a_step_stops_with_checkpoint_then_resumes(
    two_hosts: TwoHosts, server_b: Server, data: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    overrides = _overrides(
        data,
        tmp_path,
        tiny_model_dir,
        server_b,
        **{"trainer.max_steps": 3, "trainer.ckpt_interval": 1, "trainer.eval_interval": -1},
    )
    log = tmp_path / "cut.log"
    process = _train(two_hosts, overrides, log)
    first = tmp_path / "ckpts" / "global_step_1"
    try:
        wait_until(lambda: first.is_dir() or process.poll() is not None, 240, "first checkpoint")
        assert process.poll() is None, log.read_text()[-4000:]
        two_hosts.link(up=False)
        cut = time.monotonic()
        try:
            code = process.wait(timeout=3 * (HTTP_TIMEOUT_S + SYNC_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            pytest.fail(f"the run did not notice the cut link in time:\n{log.read_text()[-4000:]}")
        noticed_s = time.monotonic() - cut
    finally:
        two_hosts.link(up=True)
        if process.poll() is None:
            two_hosts.a.kill_all()
    text = log.read_text(errors="replace")
    assert code == 3, text[-4000:]  # stopped: the only engine is unreachable
    final = [line for line in text.splitlines() if line.startswith("skylift: training stopped")]
    assert final and two_hosts.b.ip in final[-1], text[-4000:]  # names the peer
    assert "trainer.resume_mode=latest" in final[-1]
    print(f"link cut noticed and run stopped in {noticed_s:.1f} s: {final[-1][:300]}")
    _assert_nothing_left(two_hosts)
    from skylift.rl import checkpoint as ckpt

    latest = ckpt.latest_checkpoint(tmp_path / "ckpts")
    assert latest is not None
    resumed_from = int(latest.name.rsplit("_", 1)[1])
    assert resumed_from >= 1

    wait_until(lambda: two_hosts.a.call(_healthy, server_b.url), 60, "host B reachable again")
    process = _train(two_hosts, overrides, tmp_path / "resume.log")
    try:
        code = process.wait(timeout=300)
    finally:
        if process.poll() is None:
            two_hosts.a.kill_all()
    text = (tmp_path / "resume.log").read_text(errors="replace")
    assert code == 0, text[-4000:]
    steps = [m["step"] for m in _metrics(tmp_path) if "reward/mean" in m]
    assert steps[-(3 - resumed_from) :] == list(range(resumed_from + 1, 4)), steps
    _assert_nothing_left(two_hosts)


@pytest.fixture
def server_a(two_hosts: TwoHosts, tiny_model_dir: Path, tmp_path: Path) -> Iterator[Server]:
    """A second server, on host A beside the trainer (its workers share the trainer's host)."""
    a = two_hosts.a
    try:
        yield from _serving(two_hosts, a, "A", tiny_model_dir, tmp_path / "server-a.log")
    finally:
        a.kill_all(grace_s=20.0)


def test_an_engine_beside_the_trainer_takes_shared_memory_and_a_remote_one_gloo(
    two_hosts: TwoHosts, server_b: Server, server_a: Server, data: Path, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Two engines, one on the trainer's host and one on host B: a mix. Each is served its own way
    (`weight_sync.mixed`): shared memory for A's, a gloo group over the link for B's; after each
    sync both sample with the trainer's weights."""
    overrides = _overrides(
        data,
        tmp_path,
        tiny_model_dir,
        server_b,
        **{
            "generator.remote_inference_engine_urls": f"['{server_a.url}','{server_b.url}']",
            "trainer.max_steps": 2,
            "trainer.eval_interval": -1,
            "generator.http_timeout_s": CALM_TIMEOUT_S,
            "generator.weight_sync_timeout_s": CALM_TIMEOUT_S,
        },
    )
    text = _train_to_the_end(two_hosts, overrides, tmp_path / "train.log")
    assert "ipc for engine(s) [0], one gloo group for engine(s) [1]]" in text, text[-4000:]
    assert f"engine(s) [1]: weight sync: 1 engine(s) dial {two_hosts.a.ip}" in text, text[-4000:]
    steps = [m for m in _metrics(tmp_path) if "reward/mean" in m]
    assert [m["step"] for m in steps] == [1, 2]
    for m in steps:  # both engines sample with the trainer's weights after each sync
        assert m["policy/logprob_diff_vs_rollout"] < 1e-3, m
        assert m["weight_sync/via/ipc+gloo"] == 1.0 and m["weight_sync/ipc/bytes"] > 0, m
        assert m["weight_sync/gloo/bytes"] > 0, m
    print("mixed weight sync (s):", [round(m["timing/weight_sync_s"], 3) for m in steps])
