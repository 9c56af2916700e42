"""`trainer.policy.torch_profiler_config`: a torch.profiler trace of each chosen training step on
each chosen rank (skylift.worker.profiler), from a real training worker on the tiny model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from test_training_worker import _batch

from skylift.algorithms import mini_batch_totals
from skylift.cluster.settings import model_worker_settings
from skylift.compat.skyrl.unused_keys import SKYRL_WITHOUT_EFFECT
from skylift.config import load_config
from skylift.rl.objective import PolicyObjective
from skylift.worker.profiler import ProfilerSettings
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings


def test_the_chosen_steps_trace_opens_and_holds_that_steps_passes(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # two mini-batches (optimizer steps) a training step; trace step 2 = optimizer steps 2 and 3
    profiler = ProfilerSettings(
        str(tmp_path / "profiles"), steps=(2,), ranks=(0,), optimizer_steps_per_step=2
    )
    settings = WorkerSettings(
        model_path=str(tiny_model_dir), optimizer=OptimizerSettings(lr=1e-3), profiler=profiler
    )
    worker = TrainingWorker(settings, init_method=f"file://{tmp_path / 'rdzv'}")
    worker.setup()
    batch = _batch(vocab=500, rows=4)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    try:
        for _ in range(4):  # training steps 1 and 2
            worker.train_mini_batch(batch, objective, micro_batch_size=4)
    finally:
        worker.shutdown()
    trace = tmp_path / "profiles" / "rank_0_step_2.json"
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == [trace.name]
    assert f"torch.profiler trace of training step 2 (rank 0): {trace}" in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"skylift/train_step_2/optimizer_step_2", "skylift/train_step_2/optimizer_step_3"} <= names
    assert not any(n.startswith("skylift/train_step_1") for n in names)
    assert any(n.startswith("aten::") for n in names)  # the CPU operators themselves


def test_a_rank_not_chosen_writes_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    profiler = ProfilerSettings(str(tmp_path / "profiles"), steps=(1,), ranks=(1,))
    settings = WorkerSettings(
        model_path=str(tiny_model_dir), optimizer=OptimizerSettings(lr=1e-3), profiler=profiler
    )
    worker = TrainingWorker(settings, init_method=f"file://{tmp_path / 'rdzv'}")
    worker.setup()
    batch = _batch(vocab=500, rows=2)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    try:
        worker.train_mini_batch(batch, objective, micro_batch_size=2)
    finally:
        worker.shutdown()
    assert not (tmp_path / "profiles").exists()


def test_skyrls_keys_reach_the_policy_workers_and_no_longer_warn(tmp_path: Path) -> None:
    cfg = load_config(
        [
            "trainer.policy.torch_profiler_config.enable=true",
            "trainer.policy.torch_profiler_config.ranks=[0,1]",
            "trainer.policy.torch_profiler_config.steps=[3]",
            "trainer.train_batch_size=8",
            "trainer.policy_mini_batch_size=4",
            f"trainer.log_dir={tmp_path / 'logs'}",
        ]
    )
    policy = model_worker_settings(cfg, trainable=True, total_steps=5).profiler
    assert policy == ProfilerSettings(str(tmp_path / "logs" / "profiles"), (3,), (0, 1), 2)
    assert model_worker_settings(cfg, trainable=False, total_steps=5).profiler is None  # the reference
    assert not any(key.startswith("trainer.policy.torch_profiler_config") for key in SKYRL_WITHOUT_EFFECT)
    off = load_config([f"trainer.log_dir={tmp_path / 'logs'}"])
    assert model_worker_settings(off, trainable=True, total_steps=5).profiler is None
