"""What the training-run benchmarks share: one run per child process, timed the same way.

A benchmark that compares training modes (`async_vs_sync.py`, `fully_async_vs_sync.py`) runs
each mode in a child process of its own (a fresh engine, the same seed and data): the parent
calls `run_child`, the child `timed_fit` then `step_figures`. The step time compared is the mean
`timing/step_s` of steps 2..N-1, the steady state: step 1 of an async run fills its pipeline and
step N has nothing to overlap with (a benchmark whose pipeline takes longer to fill skips more
first steps: `step_figures(warmup=...)`).

Benchmarks run as `python benchmarks/NAME.py`, so this module is importable as `_runs`.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any


def run_overrides(data: Path, run_dir: Path, run_name: str, steps: int) -> list[str]:
    """A benchmark run's data, length and outputs: no evaluation, checkpoints or exports."""
    return [
        f"data.train_data=['{data / 'train.parquet'}']",
        "data.val_data=[]",
        f"trainer.run_name={run_name}",
        f"trainer.max_steps={steps}",
        "trainer.eval_before_train=false",
        "trainer.eval_interval=-1",
        "trainer.ckpt_interval=-1",
        "trainer.hf_save_interval=-1",
        "trainer.resume_mode=none",
        f"trainer.ckpt_path={run_dir / 'ckpts'}",
        f"trainer.export_path={run_dir / 'exports'}",
        f"trainer.log_dir={run_dir / 'logs'}",
        "trainer.logger=console",
    ]


def timed_fit(
    overrides: Sequence[str], after_setup: Callable[[Any], dict[str, Any]] | None = None
) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """Set up an `RLTrainer` from `overrides`, call `after_setup(runtime)` (its dict joins the
    figures), train and shut down: the training steps' history and the run's figures."""
    from skylift.config import load_config
    from skylift.rl.build import build_run

    started = time.perf_counter()
    runtime, trainer = build_run(load_config(list(overrides)), console=True)
    figures: dict[str, Any] = {}
    try:
        trainer.setup()
        figures["setup_s"] = round(time.perf_counter() - started, 2)
        if after_setup is not None:
            figures.update(after_setup(runtime))
        started = time.perf_counter()
        history = trainer.fit()
        figures["fit_s"] = round(time.perf_counter() - started, 2)
    finally:
        trainer.shutdown()
    return [h for h in history if "reward/mean" in h], figures


def step_figures(rows: Sequence[dict[str, float]], phases: Sequence[str], warmup: int = 1) -> dict[str, Any]:
    """Mean step time and phases of steps `warmup + 1`..N-1 (all steps when there are none such),
    every step's time and reward, and the largest staleness."""
    timed = rows[warmup:-1] or rows
    return {
        "step_s": statistics.fmean(h["timing/step_s"] for h in timed),
        "step_s_median": statistics.median(h["timing/step_s"] for h in timed),
        "step_times": [round(h["timing/step_s"], 3) for h in rows],
        "phases": {p: statistics.fmean(h.get(f"timing/{p}", 0.0) for h in timed) for p in phases},
        "rewards": [round(h["reward/mean"], 4) for h in rows],
        "final_reward": rows[-1]["reward/mean"],
        "staleness_max": max(h["async/staleness_max"] for h in rows),
    }


def run_child(script: str, label: str, out: Path, args: Sequence[str], attempts: int = 1) -> dict[str, Any]:
    """Run `script --out OUT ARGS` in a child process and return the JSON it wrote to `out`.

    A child that fails runs again from the start, up to `attempts` runs in all (on a loaded
    shared machine a run can die of its surroundings: Ray's fixed 30 s wait for its raylet, the
    kernel's OOM killer); the last failure is raised."""
    for attempt in range(1, attempts + 1):
        print(
            f"[bench] {label} ..." + (f" (attempt {attempt} of {attempts})" if attempt > 1 else ""),
            flush=True,
        )
        try:
            subprocess.run([sys.executable, script, "--out", str(out), *args], check=True)
            break
        except subprocess.CalledProcessError as exc:
            if attempt == attempts:
                raise
            print(f"[bench] {label} failed ({exc}); running it again", flush=True)
    return dict(json.loads(out.read_text()))
