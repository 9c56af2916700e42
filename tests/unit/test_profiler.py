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
from skylift.config import ConfigError, load_config
from skylift.config.schema import OptimizerConfig
from skylift.rl.objective import PolicyObjective
from skylift.worker.profiler import ProfilerSettings
from skylift.worker.training_worker import OptimizerSettings, TrainingWorker, WorkerSettings


def test_the_scheduled_steps_trace_opens_and_holds_that_steps_passes(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # two mini-batches (optimizer steps) a training step; the schedule skips step 1, warms up in
    # step 2 and traces step 3 (optimizer steps 4 and 5); step 4 runs after the schedule ended
    profiler = ProfilerSettings(str(tmp_path / "profiles"), skip_first=1, optimizer_steps_per_step=2)
    assert profiler.last_step() == 3
    settings = WorkerSettings(
        model_path=str(tiny_model_dir),
        optimizer=OptimizerSettings(OptimizerConfig(lr=1e-3, weight_decay=0.0)),
        profiler=profiler,
    )
    worker = TrainingWorker(settings, init_method=f"file://{tmp_path / 'rdzv'}")
    worker.setup()
    batch = _batch(vocab=500, rows=4)
    totals = mini_batch_totals(batch.response_mask)
    objective = dataclasses.replace(
        PolicyObjective(), token_count=totals.token_count, seq_count=totals.seq_count
    )
    try:
        for _ in range(8):  # training steps 1 to 4
            worker.train_mini_batch(batch, objective, micro_batch_size=4)
    finally:
        worker.shutdown()
    trace = tmp_path / "profiles" / "rank_0_step_3.pt.trace.json"
    assert sorted(p.name for p in (tmp_path / "profiles").iterdir()) == [trace.name]
    assert f"torch.profiler trace of training step 3 (rank 0): {trace}" in capsys.readouterr().out
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e.get("name", "") for e in events}
    assert {"skylift/train_step_3/optimizer_step_4", "skylift/train_step_3/optimizer_step_5"} <= names
    assert not any(n.startswith(("skylift/train_step_2", "skylift/train_step_4")) for n in names)
    assert any(n.startswith("aten::") for n in names)  # the CPU operators themselves


def test_a_rank_not_chosen_writes_nothing(tiny_model_dir: Path, tmp_path: Path) -> None:
    profiler = ProfilerSettings(str(tmp_path / "profiles"), ranks=(1,), skip_first=0, warmup=0)
    settings = WorkerSettings(
        model_path=str(tiny_model_dir),
        optimizer=OptimizerSettings(OptimizerConfig(lr=1e-3, weight_decay=0.0)),
        profiler=profiler,
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
    key = "trainer.policy.torch_profiler_config"
    cfg = load_config(
        [
            f"{key}.enable=true",
            f"{key}.ranks=[0,1]",
            f"{key}.skip_first=2",
            f"{key}.active=2",
            f"{key}.use_gzip=true",
            "trainer.train_batch_size=8",
            "trainer.policy_mini_batch_size=4",
            f"trainer.log_dir={tmp_path / 'logs'}",
        ]
    )
    policy = model_worker_settings(cfg, trainable=True, total_steps=5).profiler
    assert policy == ProfilerSettings(
        str(tmp_path / "logs" / "profiles"),
        (0, 1),
        skip_first=2,
        active=2,
        use_gzip=True,
        optimizer_steps_per_step=2,
    )
    assert model_worker_settings(cfg, trainable=False, total_steps=5).profiler is None  # the reference
    assert not any(k.startswith(key) for k in SKYRL_WITHOUT_EFFECT)
    off = load_config([f"trainer.log_dir={tmp_path / 'logs'}"])
    assert model_worker_settings(off, trainable=True, total_steps=5).profiler is None
    stacks = load_config([f"{key}.enable=true", f"{key}.export_type=stacks", f"{key}.with_stack=false"])
    with pytest.raises(ConfigError, match=f"{key}.export_type=stacks needs {key}.with_stack=true"):
        model_worker_settings(stacks, trainable=True, total_steps=5)
    with pytest.raises(ConfigError, match="activities='tpu' is not one of cpu, cuda"):
        load_config([f"{key}.activities=[cpu,tpu]"])
