"""Where metrics go: every tracker gets `log(metrics, step)` and `log_samples(rows, step, key)` (a
table of sampled rollouts, `skylift.rl.rollout_records.table_rows`); `Tracking` fans out to all of them."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
Rows = list[dict[str, Any]]


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def log_samples(self, rows: Rows, step: int, key: str) -> None: ...

    def close(self) -> None: ...


class JsonlTracker:
    """One JSON object per `log` call in `metrics.jsonl` (always on: plots read it)."""

    def __init__(self, log_dir: Path) -> None:
        log_dir.mkdir(parents=True, exist_ok=True)
        self.path = log_dir / "metrics.jsonl"
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, metrics: dict[str, float], step: int) -> None:
        row = {"step": step, "time": time.time(), **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def log_samples(self, rows: Rows, step: int, key: str) -> None:
        """Nothing: the samples are in the run's records (`<log_dir>/rollouts`)."""

    def close(self) -> None:
        self._file.close()


class TensorboardTracker:
    def __init__(self, log_dir: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(log_dir=str(log_dir / "tensorboard"))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for key, value in metrics.items():
            if isinstance(value, int | float) and math.isfinite(float(value)):
                self._writer.add_scalar(key, float(value), step)
        self._writer.flush()

    def log_samples(self, rows: Rows, step: int, key: str) -> None:
        self._writer.add_text(key, markdown_table(rows), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    def __init__(self, project: str, run_name: str, config: dict[str, Any], log_dir: Path) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run_name, config=config, dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def log_samples(self, rows: Rows, step: int, key: str) -> None:
        import wandb

        columns = list(rows[0]) if rows else []
        table = wandb.Table(columns=columns, data=[[row[c] for c in columns] for row in rows])
        self._run.log({key: table}, step=step)

    def close(self) -> None:
        self._run.finish()


class Tracking:
    """The trackers named in `trainer.logger`; JSONL is always written to `log_dir`.

    `console` prints nothing here (the trainer prints its own one-line summaries); `wandb` is
    used when named and `WANDB_API_KEY` is set or `WANDB_MODE` is offline, otherwise a note says
    why it is skipped; `mlflow` logs to `MLFLOW_TRACKING_URI`, else a file store in
    `<log_dir>/mlruns`.
    """

    def __init__(
        self,
        names: list[str],
        log_dir: Path,
        project: str,
        run_name: str,
        config: dict[str, Any] | None = None,
    ) -> None:
        self.trackers: list[Tracker] = [JsonlTracker(log_dir)]
        self.jsonl_path = log_dir / "metrics.jsonl"
        for name in names:
            if name in ("console", "jsonl"):
                continue
            if name == "tensorboard":
                self.trackers.append(TensorboardTracker(log_dir))
            elif name == "wandb":
                if not os.environ.get("WANDB_API_KEY") and os.environ.get("WANDB_MODE") not in _OFFLINE:
                    print(
                        "[skylift] trainer.logger includes wandb but WANDB_API_KEY is not set: skipping wandb",
                        file=sys.stderr,
                    )
                    continue
                self.trackers.append(WandbTracker(project, run_name, config or {}, log_dir))
            elif name == "mlflow":
                from skylift.tracking.mlflow_tracker import MlflowTracker

                self.trackers.append(MlflowTracker(project, run_name, config or {}, log_dir))
            else:
                raise ValueError(unknown_logger(name))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def log_samples(self, rows: Rows, step: int, key: str) -> None:
        """A table of sampled rollouts (`key`: e.g. samples/train) in every tracker that shows one."""
        if rows:
            for tracker in self.trackers:
                tracker.log_samples(rows, step, key)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


_OFFLINE = ("offline", "dryrun", "disabled")
_NOT_SUPPORTED = {
    "swanlab": "swanlab needs its cloud service or its own local server; use wandb (offline: "
    "WANDB_MODE=offline), mlflow (a local file store) or tensorboard",
}


def unknown_logger(name: str) -> str:
    """The one-line refusal of a tracker name skylift does not have."""
    why = f" ({_NOT_SUPPORTED[name]})" if name in _NOT_SUPPORTED else ""
    return f"unknown logger {name!r}{why}; known loggers: {', '.join(KNOWN_LOGGERS)}"


def markdown_table(rows: Rows) -> str:
    """`rows` as a Markdown table (tensorboard renders text summaries as Markdown)."""
    if not rows:
        return ""
    columns = list(rows[0])

    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row[c]) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value
