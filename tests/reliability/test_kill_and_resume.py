"""Kill the trainer at a random point, resume, and get the uninterrupted run's numbers (issue 8,
item 3).

One tiny-model server serves three runs in turn:
1. the reference: 4 uninterrupted steps (in this process);
2. the same run as a real `skylift train` subprocess with a checkpoint every step, SIGKILLed
   (with its whole process group) at a random moment of step 2 or 3;
3. `resume_mode=latest` of run 2: it continues from the last complete checkpoint with the same
   data order and, thanks to seeded sampling, the same rollouts, so every metric of every step
   equals the reference's (timings aside).

Run inside a loopback-only namespace: bash scripts/loopback.sh .venv/bin/pytest tests/reliability
"""

from __future__ import annotations

import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import (
    ServerHandle,
    require_loopback_namespace,
    start_server,
    stop_server,
    tiny_server_args,
    wait_healthy,
)

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.rl import checkpoint as ckpt
from skylift.rl.build import build_trainer

STEPS = 4
#: Seconds the killed run may take to write the checkpoint it is killed after (start-up included).
FIRST_CHECKPOINT_WAIT_S = 240.0


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """A server of its own: these runs change its weights."""
    require_loopback_namespace()
    handle = start_server(
        tiny_model_dir, tmp_path_factory.mktemp("resume-server") / "server.log", tiny_server_args()
    )
    try:
        wait_healthy(handle)
        yield handle
    finally:
        stop_server(handle, grace_s=10.0)


def _overrides(data: Path, run_dir: Path, model: Path, url: str, **extra: object) -> list[str]:
    base: dict[str, object] = {
        "trainer.policy.model.path": str(model),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": "[]",
        "environment.env_class": "arithmetic",
        "generator.run_engines_locally": False,
        "generator.remote_inference_engine_urls": f"['{url.removeprefix('http://')}']",
        "trainer.train_batch_size": 4,
        "trainer.policy_mini_batch_size": 2,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 24,
        "trainer.max_prompt_length": 128,
        "trainer.eval_before_train": False,
        "trainer.eval_interval": -1,
        "trainer.max_steps": STEPS,
        "trainer.epochs": 2,  # 12 prompts = 3 batches per epoch: the run crosses an epoch
        "trainer.skip_zero_advantage_rows": False,
        "trainer.algorithm.advantage_estimator": "rloo",
        "trainer.algorithm.use_kl_loss": True,  # a reference model too, and a KL term that moves
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.policy.optimizer_config.scheduler": "cosine",
        "trainer.ckpt_path": str(run_dir / "ckpts"),
        "trainer.export_path": str(run_dir / "exports"),
        "trainer.log_dir": str(run_dir / "logs"),
        "trainer.logger": "['console']",
        "generator.http_timeout_s": 120,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _fit(overrides: list[str]) -> list[dict]:
    trainer = build_trainer(load_config(overrides), console=False)
    try:
        trainer.setup()
        return [h for h in trainer.fit() if "reward/mean" in h]
    finally:
        trainer.shutdown()


def _same_metrics(got: dict, want: dict) -> list[str]:
    """Names of the metrics (timings aside) that differ beyond floating-point noise."""
    wall_clock = ("timing/", "generate/trajectory_time_")
    keys = {k for k in want if not k.startswith(wall_clock) and k != "checkpoint"}
    assert keys <= set(got), sorted(keys - set(got))
    return [k for k in sorted(keys) if not math.isclose(got[k], want[k], rel_tol=1e-4, abs_tol=1e-6)]


def test_killed_run_resumes_with_the_uninterrupted_runs_metrics(
    server: ServerHandle, tiny_model_dir: Path, tmp_path: Path
) -> None:
    data = tmp_path / "data"
    write_arithmetic_dataset(data, num_train=12, num_val=2, seed=3)
    # the arithmetic reward is 0 for the untrained tiny model: a KL loss and rloo still move it
    reference = _fit(_overrides(data, tmp_path / "reference", tiny_model_dir, server.url))
    assert [h["step"] for h in reference] == list(range(1, STEPS + 1))
    assert len({round(h["policy/grad_norm"], 9) for h in reference}) > 1  # the steps differ from each other

    run = tmp_path / "killed"
    cmd = [sys.executable, "-m", "skylift.entrypoints.main_base"]
    cmd += _overrides(data, run, tiny_model_dir, server.url, **{"trainer.ckpt_interval": 1})
    log = (tmp_path / "killed.log").open("wb")
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    # a random moment: within the step after checkpoint k (k = 1 or 2), at least 2 steps before
    # the end; the fastest reference step bounds the wait so a faster run is still killed in time
    rng = random.Random()
    after_step = rng.choice([1, 2])
    delay = rng.uniform(0.0, 0.5 * min(h["timing/step_s"] for h in reference[1:]))
    try:
        marker = run / "ckpts" / f"global_step_{after_step}" / ckpt.COMPLETE_MARKER
        deadline = time.monotonic() + FIRST_CHECKPOINT_WAIT_S
        while not marker.exists():
            assert process.poll() is None, (tmp_path / "killed.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"no checkpoint of step {after_step} in time"
            time.sleep(0.02)
        time.sleep(delay)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    assert process.returncode == -signal.SIGKILL, "the run ended before the kill: nothing was tested"
    latest = ckpt.latest_checkpoint(run / "ckpts")
    assert latest is not None
    done = ckpt.load_trainer_state(latest).global_step
    assert after_step <= done < STEPS, f"killed {delay:.2f} s after step {after_step}'s checkpoint: {latest}"
    print(f"killed {delay:.2f} s after step {after_step}'s checkpoint; resuming after step {done}")

    # the steps the killed run finished already agree with the reference
    logged = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]
    for row in logged:
        if "reward/mean" in row and row["step"] <= done:
            assert not _same_metrics(row, reference[row["step"] - 1]), (row["step"], row)

    resumed = _fit(_overrides(data, run, tiny_model_dir, server.url, **{"trainer.resume_mode": "latest"}))
    assert [h["step"] for h in resumed] == list(range(done + 1, STEPS + 1))
    worst = 0.0
    for got in resumed:
        want = reference[got["step"] - 1]
        differing = _same_metrics(got, want)
        assert not differing, {k: (got[k], want[k]) for k in differing}
        compared = [k for k in want if not k.startswith("timing/") and k != "checkpoint"]
        worst = max([worst, *(abs(got[k] - want[k]) / max(abs(want[k]), 1e-12) for k in compared)])
    print(f"resumed steps {done + 1}-{STEPS}: largest relative difference from the reference {worst:.1e}")
