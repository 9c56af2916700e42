"""`trainer.logger=[mlflow,wandb]` (and tensorboard): the scalars and the sample tables of a run,
in an MLflow file store and an offline wandb run; unknown loggers refused naming the known ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from rl_fakes import fake_run

from skylift.config import load_config
from skylift.config.errors import ConfigError
from skylift.config.schema import LOGGERS
from skylift.tracking import Tracking
from skylift.tracking.mlflow_tracker import mlflow_key
from skylift.tracking.trackers import KNOWN_LOGGERS


@pytest.fixture()
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("WANDB_SILENT", "true")
    # unset, and restored to unset afterwards (the tracker opts in to MLflow's file store itself)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "")
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE")


def test_mlflow_and_wandb_get_the_scalars_and_the_sample_tables(tmp_path: Path, offline: None) -> None:
    cfg = load_config([f"trainer.log_dir={tmp_path / 'logs'}", "trainer.logger=[mlflow,wandb]"])
    logs = tmp_path / "logs"
    tracking = Tracking(cfg.trainer.loggers(), logs, "viewer-test", "run-1", {"seed": 7})
    run = fake_run(
        tmp_path,
        "trainer.max_steps=2",
        "trainer.eval_interval=2",
        "trainer.rollout_records.tracker_rows=3",
        tracking=tracking,
    )
    try:
        history = run.trainer.fit()
    finally:
        run.close()
        tracking.close()
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=(logs / "mlruns").resolve().as_uri())
    experiment = client.get_experiment_by_name("viewer-test")
    (mlrun,) = client.search_runs([experiment.experiment_id])
    assert mlrun.info.run_name == "run-1" and mlrun.info.status == "FINISHED"
    rewards = client.get_metric_history(mlrun.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in rewards] == [
        (h["step"], h["reward/mean"]) for h in history if "reward/mean" in h
    ]
    assert "eval/accuracy" in mlrun.data.metrics
    artifacts = {a.path for a in client.list_artifacts(mlrun.info.run_id)}
    assert {"config.json", "samples/train_step_1.json", "samples/eval_step_2.json"} <= artifacts | {
        f"samples/{a.path.rsplit('/', 1)[-1]}" for a in client.list_artifacts(mlrun.info.run_id, "samples")
    }
    local = Path(
        client.download_artifacts(mlrun.info.run_id, "samples/train_step_1.json", str(tmp_path / "dl"))
    )
    table = json.loads(local.read_text())
    assert table["columns"][:4] == ["kind", "step", "uid", "sample"] and len(table["data"]) == 3
    # wandb, offline: the run's history has the scalars and a table per recorded step
    (wandb_run,) = (logs / "wandb").glob("offline-run-*")
    tables = sorted(
        p.name for p in (wandb_run / "files" / "media" / "table" / "samples").glob("*.table.json")
    )
    assert [name.split("_")[0] for name in tables] == ["eval", "train", "train"]
    data = json.loads(
        next((wandb_run / "files" / "media" / "table" / "samples").glob("train_1_*.table.json")).read_text()
    )
    assert data["columns"] == table["columns"] and len(data["data"]) == 3


def test_tensorboard_gets_the_table_as_text(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tracking = Tracking(["tensorboard"], tmp_path, "p", "r")
    rows = [
        {"kind": "train", "step": 3, "prompt": "What is 1 + 1?", "response": "2 | two\nok", "reward": 1.0}
    ]
    tracking.log({"reward/mean": 0.5}, 3)
    tracking.log_samples(rows, 3, "samples/train")
    tracking.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    events.Reload()
    (text,) = events.Tensors("samples/train/text_summary")
    markdown = text.tensor_proto.string_val[0].decode()
    assert text.step == 3
    assert markdown.splitlines()[:2] == [
        "| kind | step | prompt | response | reward |",
        "|---|---|---|---|---|",
    ]
    assert "| 2 \\| two<br>ok | 1 |" in markdown


def test_unknown_loggers_are_refused_naming_the_known_ones(tmp_path: Path) -> None:
    assert set(LOGGERS) == set(KNOWN_LOGGERS)  # the config's choices and the trackers agree
    with pytest.raises(ValueError) as refused:
        Tracking(["swanlab"], tmp_path, "p", "r")
    message = str(refused.value)
    assert message.startswith("unknown logger 'swanlab' (swanlab needs its cloud service")
    assert message.endswith("known loggers: console, jsonl, tensorboard, wandb, mlflow")
    with pytest.raises(ValueError, match="unknown logger 'neptune'; known loggers: console, jsonl"):
        Tracking(["neptune"], tmp_path, "p", "r")
    with pytest.raises(
        ConfigError, match="trainer.logger='swanlab' is not one of console, jsonl, tensorboard"
    ):
        load_config(["trainer.logger=[mlflow,swanlab]"])


def test_mlflow_metric_names() -> None:
    assert mlflow_key("eval/pass@4") == "eval/pass_at_4"
    assert mlflow_key("timing/step_s") == "timing/step_s"
    assert mlflow_key("env/tool calls (x)") == "env/tool calls _x_"
