"""A whole `skylift train` run with Ray placement whose only engine, a `skylift serve`, is
SIGKILLed after step 2's generation, so that step 2's weight sync meets the dead engine.

What the user gets, measured on the command's own process: the run ends within
`KILL_TO_EXIT_S` of the kill (`generator.weight_sync_timeout_s` is 300 s, so a wait on the dead
engine shows as this bound, not as the test's own subprocess timeout), with exit code 3, a
checkpoint of step 2 (the sync loaded nothing, the step counted; step 3's generation finds no
engine), skylift's one line naming the engine as the last line (shutdown used to print the
shared-memory transport's release failure after it), no traceback, and no process the run
started left behind (Ray's, the policy actor's).

Run inside a loopback-only namespace: bash scripts/loopback.sh .venv/bin/pytest tests/reliability
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
from server_helpers import (
    require_loopback_namespace,
    start_server,
    stop_server,
    tiny_server_args,
    wait_healthy,
)

from skylift.data import write_arithmetic_dataset

pytestmark = pytest.mark.integration

#: the kill to the command's exit (shutting Ray down included); the sync's timeout is 300 s
KILL_TO_EXIT_S = 60.0
#: from the access log's line of the last generate to the kill: its 3 KB answer has been sent
ANSWER_SENT_S = 1.0
#: prompts per step: each is one generate request on the server (n samples each)
PROMPTS_PER_STEP = 4


def _overrides(data: Path, run_dir: Path, model: Path, url: str) -> list[str]:
    keys: dict[str, object] = {
        "trainer.policy.model.path": model,
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": f"['{data / 'validation.parquet'}']",
        "trainer.placement.backend": "ray",
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{url.removeprefix('http://')}']",
        "generator.weight_sync_timeout_s": 300,
        "trainer.train_batch_size": PROMPTS_PER_STEP,
        "trainer.policy_mini_batch_size": PROMPTS_PER_STEP,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 16,
        "trainer.max_prompt_length": 128,
        "trainer.eval_interval": -1,
        "trainer.eval_before_train": False,
        "trainer.ckpt_interval": -1,  # only the stop after the engine loss writes a checkpoint
        "trainer.max_steps": 4,
        "trainer.runs_dir": run_dir / "runs",
        "trainer.ckpt_path": run_dir / "ckpts",
        "trainer.export_path": run_dir / "exports",
        "trainer.log_dir": run_dir / "logs",
        "trainer.logger": "['console']",
    }
    return [f"{k}={v}" for k, v in keys.items()]


def _kill_after_generations(log: Path, count: int, pgid: int, killed: list[float]) -> threading.Thread:
    """SIGKILL the server's process group once its log shows `count` generate requests answered.

    The access log's line comes as the answer starts: the kill waits `ANSWER_SENT_S` more, so the
    last answer's body has reached the run (killed mid-answer, the run loses the engine during
    step 2's generation instead, which `test_remote_answer_broken_off.py` covers) and step 2's
    training still runs (seconds), so its sync meets the dead engine."""

    def run() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            if log.read_text(errors="replace").count('"POST /skylift/generate HTTP') >= count:
                time.sleep(ANSWER_SENT_S)
                os.killpg(pgid, signal.SIGKILL)
                killed.append(time.monotonic())
                return
            time.sleep(0.01)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _watch_tree(root: int, seen: set[int], stop: threading.Event) -> threading.Thread:
    """Collect every process under `root` while it runs (Ray's and the actors' included)."""

    def run() -> None:
        while not stop.is_set():
            try:
                seen.update(p.pid for p in psutil.Process(root).children(recursive=True))
            except psutil.NoSuchProcess:
                return
            time.sleep(0.1)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _left(pids: set[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            p = psutil.Process(pid)
            if p.status() != psutil.STATUS_ZOMBIE:
                out.append(f"{pid} {p.name()}")
        except psutil.NoSuchProcess:
            pass
    return out


def test_a_ray_run_whose_engine_dies_before_a_sync_ends_at_once_with_one_line(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    require_loopback_namespace()
    data = tmp_path / "data"
    write_arithmetic_dataset(data, num_train=32, num_val=8, seed=0)
    started = time.monotonic()
    server = start_server(tiny_model_dir, tmp_path / "server.log", tiny_server_args())
    try:
        wait_healthy(server)
        serving = time.monotonic()
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
        run = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "skylift.cli",
                "train",
                *_overrides(data, tmp_path, tiny_model_dir, server.url),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        seen: set[int] = set()
        stop = threading.Event()
        watcher = _watch_tree(run.pid, seen, stop)
        killed: list[float] = []
        killer = _kill_after_generations(
            tmp_path / "server.log", 2 * PROMPTS_PER_STEP, server.process.pid, killed
        )
        try:
            output, _ = run.communicate(timeout=600)
        except subprocess.TimeoutExpired:
            os.killpg(run.pid, signal.SIGKILL)
            output, _ = run.communicate()
            pytest.fail(f"skylift train did not end within 600 s:\n{output[-4000:]}")
        ended = time.monotonic()
        stop.set()
        watcher.join(timeout=5)
        killer.join(timeout=5)
    finally:
        stop_server(server, grace_s=10.0)
    lines = [line for line in output.splitlines() if line.strip()]
    tail = "\n".join(lines[-15:])
    assert killed, f"the server was never killed (fewer generate requests than expected):\n{tail}"
    print(
        f"server up in {serving - started:.1f} s, the run {ended - serving:.1f} s; kill to exit "
        f"{ended - killed[0]:.1f} s; exit code {run.returncode}; last line: {lines[-1]}"
    )
    assert ended - killed[0] < KILL_TO_EXIT_S, tail
    assert run.returncode == 3, tail
    assert "weights of version 2 published, loaded by no engine" in output, tail  # the sync met it
    assert lines[-1].startswith(
        "skylift: training stopped during step 3: no healthy inference engine left"
    ), tail
    assert server.url in lines[-1] and "resume_mode=latest" in lines[-1], tail
    assert "Traceback" not in output, tail
    assert (tmp_path / "ckpts" / "global_step_2").is_dir(), tail
    deadline = time.monotonic() + 15
    while _left(seen) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not _left(seen), f"processes of the run left behind: {_left(seen)}"
