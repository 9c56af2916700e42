"""`trainer.logger=mlflow`: scalars, the run's config and sample tables in an MLflow run.

The run goes to `MLFLOW_TRACKING_URI` when set (a server, a database), else to a file store in
`<log_dir>/mlruns` (MLflow 3 wants `MLFLOW_ALLOW_FILE_STORE=true` for it, which is then set;
`mlflow ui --backend-store-uri <log_dir>/mlruns` shows the run); the experiment is the project name.
"""

from __future__ import annotations

import os
import re
import time
import warnings
from pathlib import Path
from typing import Any

_NOT_IN_KEYS = re.compile(r"[^0-9A-Za-z_\-. /]")  # MLflow's allowed characters in a metric name


def mlflow_key(name: str) -> str:
    """A metric name MLflow accepts (`eval/pass@4` -> `eval/pass_at_4`)."""
    return _NOT_IN_KEYS.sub("_", name.replace("@", "_at_"))


class MlflowTracker:
    def __init__(self, project: str, run_name: str, config: dict[str, Any], log_dir: Path) -> None:
        try:
            from mlflow import MlflowClient
        except ImportError as exc:
            raise ValueError(
                "trainer.logger includes mlflow but the MLflow client is not installed: "
                "pip install 'skylift[mlflow]' (or pip install mlflow)"
            ) from exc

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or ""
        if not self.uri:  # MLflow 3 keeps its file store behind this opt-in
            self.uri = (log_dir / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._client = MlflowClient(tracking_uri=self.uri)
        experiment = self._client.get_experiment_by_name(project)
        experiment_id = (
            experiment.experiment_id if experiment is not None else self._client.create_experiment(project)
        )
        self.run_id = self._client.create_run(experiment_id, run_name=run_name).info.run_id
        if config:
            self._client.log_dict(self.run_id, config, "config.json")

    def log(self, metrics: dict[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        batch = [
            Metric(mlflow_key(key), float(value), now, step)
            for key, value in metrics.items()
            if isinstance(value, int | float) and value == value  # NaN: not a figure
        ]
        for start in range(0, len(batch), 1000):  # MLflow takes at most 1000 metrics a call
            self._client.log_batch(self.run_id, metrics=batch[start : start + 1000])

    def log_samples(self, rows: list[dict[str, Any]], step: int, key: str) -> None:
        """The rows as an MLflow table artifact (`<key>_step_<N>.json`)."""
        columns = list(rows[0]) if rows else []
        data = {c: [row[c] for row in rows] for c in columns}
        with warnings.catch_warnings():  # MLflow's own pandas deprecation notices, not the user's
            warnings.simplefilter("ignore")
            self._client.log_table(
                self.run_id, data=data, artifact_file=f"{mlflow_key(key)}_step_{step}.json"
            )

    def close(self) -> None:
        self._client.set_terminated(self.run_id)
