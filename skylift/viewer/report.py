"""`skylift view RUN_DIR`: the run's records as a self-contained HTML report in `<RUN_DIR>/viewer/`.

It reads what the run wrote: the rollout records (`<log_dir>/rollouts/*.json`, see
`skylift.rl.rollout_records`) and the step times of `<log_dir>/metrics.jsonl`. The report is
`index.html` with its stylesheet and script (plain HTML, CSS and JavaScript, no network) and one
`data/<record>.js` per recorded step or evaluation, loaded when it is opened, so a long run's report
opens as fast as a short one's.
"""

from __future__ import annotations

import json
import math
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from skylift.rl.rollout_records import RECORDS_DIR

ASSETS = ("index.html", "viewer.css", "viewer.js")
#: step-time parts of the chart: (label, metrics.jsonl key); "experience" is the trainer's logprob pass
TIMINGS = (
    ("generate", "timing/generate_s"),
    ("wait", "timing/wait_s"),
    ("experience", "timing/logprobs_s"),
    ("train", "timing/train_s"),
    ("sync", "timing/weight_sync_s"),
    ("eval", "timing/eval_s"),
    ("records", "timing/rollout_records_s"),
)


class NoRecordsError(ValueError):
    """RUN_DIR holds nothing the viewer can show."""


def logs_dir_of(run_dir: Path) -> Path:
    """The run's log folder: `<RUN_DIR>/logs` (a run folder) or RUN_DIR itself (its log_dir)."""
    for candidate in (run_dir / "logs", run_dir):
        if (candidate / RECORDS_DIR).is_dir() or (candidate / "metrics.jsonl").is_file():
            return candidate
    raise NoRecordsError(
        f"{run_dir} holds no run records: expected {run_dir}/logs/{RECORDS_DIR} or "
        f"{run_dir}/logs/metrics.jsonl (a training run's folder or its trainer.log_dir)"
    )


def build_report(run_dir: Path, out_dir: Path | None = None) -> Path:
    """Write the report of the run in `run_dir`; returns the path of its index.html."""
    run_dir = run_dir.expanduser().resolve()
    if not run_dir.is_dir():
        raise NoRecordsError(f"{run_dir} is not a directory")
    logs = logs_dir_of(run_dir)
    out = out_dir or run_dir / "viewer"
    data_dir = out / "data"
    if data_dir.is_dir():
        shutil.rmtree(data_dir)  # records of an earlier report that are gone now
    data_dir.mkdir(parents=True)
    index: dict[str, Any] = {"run": run_dir.name, "train": [], "eval": [], "timings": timings(logs)}
    for path in sorted((logs / RECORDS_DIR).glob("*.json"), key=_record_order):
        record = json.loads(path.read_text())
        name = path.stem
        (data_dir / f"{name}.js").write_text(f"skyliftView.add({json.dumps(name)}, {json.dumps(record)});\n")
        index[record["kind"]].append({"name": name, **summary(record)})
    (data_dir / "index.js").write_text(f"skyliftView.index({json.dumps(index)});\n")
    assets = resources.files("skylift.viewer") / "assets"
    for asset in ASSETS:
        (out / asset).write_text((assets / asset).read_text(encoding="utf-8"), encoding="utf-8")
    return out / "index.html"


def summary(record: dict[str, Any]) -> dict[str, Any]:
    """A record's line in the report's list: step, counts, mean reward; evaluations' accuracy, pass@k."""
    samples = [s for g in record["groups"] for s in g["samples"]]
    rewards = [s["reward"] for s in samples]
    out: dict[str, Any] = {
        "step": record["step"],
        "groups": len(record["groups"]),
        "samples": len(samples),
        "reward_mean": sum(rewards) / len(rewards) if rewards else None,
    }
    if record["kind"] == "eval" and samples:
        k = max(len(g["samples"]) for g in record["groups"])
        out["accuracy"] = sum(bool(s.get("correct")) for s in samples) / len(samples)
        out["k"] = k
        out["pass_at_k"] = sum(any(s.get("correct") for s in g["samples"]) for g in record["groups"]) / len(
            record["groups"]
        )
    return out


def timings(logs: Path) -> list[dict[str, float]]:
    """Per training step, the seconds of each part of `TIMINGS` (and the whole step) from metrics.jsonl."""
    path = logs / "metrics.jsonl"
    if not path.is_file():
        return []
    rows: dict[int, dict[str, float]] = {}
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by a killed run
        if not isinstance(row.get("timing/step_s"), int | float):
            continue
        parts = {label: _seconds(row.get(key)) for label, key in TIMINGS}
        rows[int(row["step"])] = {"step": int(row["step"]), "step_s": _seconds(row["timing/step_s"]), **parts}
    return [rows[s] for s in sorted(rows)]  # a resumed run's repeated steps: the last one


def _seconds(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else 0.0


def _record_order(path: Path) -> tuple[str, int]:
    kind, _, step = path.stem.rpartition("_step_")
    return kind, int(step) if step.isdigit() else -1
