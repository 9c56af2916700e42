"""Where metrics go: every tracker gets `log(metrics, step)`; `Tracking` fans out to all of them."""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Protocol


class Tracker(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

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

    def close(self) -> None:
        self._writer.close()


class WandbTracker:
    def __init__(self, project: str, run_name: str, config: dict[str, Any], log_dir: Path) -> None:
        import wandb

        self._run = wandb.init(project=project, name=run_name, config=config, dir=str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


class Tracking:
    """The trackers named in `trainer.logger`; JSONL is always written to `log_dir`.

    `console` prints nothing here (the trainer prints its own one-line summaries); `wandb` is
    used when named and `WANDB_API_KEY` is set, otherwise a note says why it is skipped.
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
                if not os.environ.get("WANDB_API_KEY"):
                    print(
                        "[skylift] trainer.logger includes wandb but WANDB_API_KEY is not set: skipping wandb",
                        file=sys.stderr,
                    )
                    continue
                self.trackers.append(WandbTracker(project, run_name, config or {}, log_dir))
            else:
                raise ValueError(f"unknown logger {name!r}; use console, jsonl, tensorboard or wandb")

    def log(self, metrics: dict[str, float], step: int) -> None:
        for tracker in self.trackers:
            tracker.log(metrics, step)

    def close(self) -> None:
        for tracker in self.trackers:
            tracker.close()


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if hasattr(value, "item"):
        return value.item()
    return value
