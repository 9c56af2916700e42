"""A weight sync's figures reach the run's trackers and its step line: `EngineWeights.sync` returns
the transport's push figures (`sync_metrics`), the RL loop logs them with the step's, the colocated
wrapper adds its moves. The real `EngineWeights` over fake engines: tests/unit/test_engine_weights.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from rl_fakes import fake_run

from skylift.cluster.colocated_weights import OffloadedGroup, OffloadingEngineWeights
from skylift.cluster.engine_weights import sync_metrics
from skylift.config import load_config
from skylift.rl.console import step_summary
from skylift.tracking import Tracking


def test_a_push_becomes_the_steps_figures() -> None:
    pushed = {"timing/weight_sync_s": 0.4, "weight_sync/bytes": 270e6, "weight_sync/streamed": 1.0}
    assert sync_metrics("ipc", pushed) == {
        "timing/weight_sync_push_s": 0.4,  # the transport's own time; timing/weight_sync_s is the driver's
        "weight_sync/bytes": 270e6,
        "weight_sync/streamed": 1.0,
        "weight_sync/via/ipc": 1.0,
    }
    assert sync_metrics("gloo", {}) == {}  # nothing loaded (no engine left): no figures


def test_the_sync_figures_reach_the_trackers_and_the_step_line(tmp_path: Path) -> None:
    cfg = load_config([f"trainer.log_dir={tmp_path / 'logs'}", "trainer.logger=[jsonl]"])
    tracking = Tracking(cfg.trainer.loggers(), tmp_path / "logs", "p", "r", {})
    run = fake_run(tmp_path, "trainer.max_steps=2", tracking=tracking)
    try:
        history = run.trainer.fit()
    finally:
        run.close()
        tracking.close()
    rows = [json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "reward/mean" in r]
    assert [r["step"] for r in steps] == [1, 2] and run.weights.syncs == [1, 2]
    for row in steps:
        assert row["weight_sync/bytes"] == 2.5e6 and row["timing/weight_sync_push_s"] == 0.25
        assert row["weight_sync/via/fake"] == 1.0
        assert row["timing/weight_sync_s"] > 0 and row["timing/weight_sync_s"] != 0.25  # the loop's own
    line = step_summary(2, 2, history[-1])
    assert f"sync {history[-1]['timing/weight_sync_s']:.1f}s (fake 2.5 MB) idle" in line


def test_a_step_without_a_push_shows_no_transport() -> None:
    m = {
        "reward/mean": 0.5,
        "response_length/mean": 3.0,
        "timing/generate_s": 1.0,
        "timing/wait_s": 0.0,
        "timing/train_s": 1.0,
        "timing/weight_sync_s": 0.0,
        "timing/idle_s": 0.0,
    }
    assert "sync 0.0s idle" in step_summary(1, 2, m)
    big = {**m, **sync_metrics("gloo", {"weight_sync/bytes": 538e6})}
    assert "sync 0.0s (gloo 538 MB) idle" in step_summary(1, 2, big)


class _Inner:
    asleep = True

    def sync(self, version: int) -> dict[str, float]:
        self.asleep = False
        return sync_metrics("ipc", {"timing/weight_sync_s": 0.1, "weight_sync/bytes": 8.0})

    def sleep(self) -> None:
        self.asleep = True


class _Group:
    def call_all(self, method: Any, parts: tuple[str, ...]) -> list[dict[str, float]]:
        key = "offloaded_gib" if method.__name__ == "offload_to_host" else "backloaded_gib"
        return [{key: 0.5 * len(parts)}]


def test_colocated_syncs_add_the_moves_figures() -> None:
    weights = OffloadingEngineWeights(_Inner(), [OffloadedGroup(_Group(), ("optimizer",), ("model",))], print)  # type: ignore[arg-type]
    weights.sleep()
    figures = weights.sync(1)
    assert figures["weight_sync/bytes"] == 8.0 and figures["weight_sync/via/ipc"] == 1.0
    assert figures["colocation/backload_to_device_gib"] == 1.0  # this step's backload, after sleep
    assert figures["colocation/offload_to_host_gib"] == 1.0  # after the push: optimizer + model
    assert figures["timing/offload_s"] >= 0 and figures["timing/backload_s"] >= 0
