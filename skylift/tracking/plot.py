"""`skylift plot RUN_DIR`: a PNG of training reward and evaluation accuracy per step."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(jsonl: Path) -> list[dict]:
    rows = []
    for line in jsonl.read_text().splitlines():
        line = line.strip()
        if line:
            rows.append(json.loads(line))
    return rows


def find_metrics_file(run_dir: str | Path) -> Path:
    run = Path(run_dir)
    for candidate in (run / "metrics.jsonl", run / "logs" / "metrics.jsonl"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no metrics.jsonl in {run} or {run / 'logs'}")


def accuracy_series(rows: list[dict]) -> list[str]:
    """The `eval/*accuracy*` keys to draw (their `_stderr` become error bars): the per-data-source
    ones only when there are several sources (with one, `eval/<source>/accuracy` is `eval/accuracy`
    again; a source's name may hold slashes, e.g. `skylift/addition-demo`)."""
    keys = sorted(
        {
            k
            for r in rows
            for k in r
            if k.startswith("eval/") and "accuracy" in k and not k.endswith("_stderr")
        }
    )
    per_source = [k for k in keys if k != "eval/accuracy" and k.endswith("/accuracy")]
    if len(per_source) == 1 and "eval/accuracy" in keys:
        keys.remove(per_source[0])
    return keys


def run_title(jsonl: Path) -> str:
    """The run's name: the directory holding `logs/metrics.jsonl` (or `metrics.jsonl`)."""
    logs = jsonl.parent
    return logs.parent.name if logs.name == "logs" else logs.name


def plot_run(run_dir: str | Path, out: str | Path | None = None, title: str | None = None) -> Path:
    """Plot `reward/mean` (train) and the evaluation accuracy series against the step, titled
    `title` (default: the run's directory name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    jsonl = find_metrics_file(run_dir)
    rows = read_metrics(jsonl)
    out_path = Path(out) if out else jsonl.parent / "training_curves.png"
    fig, (ax_reward, ax_eval) = plt.subplots(1, 2, figsize=(11, 4))
    train = [(r["step"], r["reward/mean"]) for r in rows if r.get("reward/mean") is not None]
    if train:
        ax_reward.plot(*zip(*train, strict=True), marker="o", label="train reward (mean)")
    ax_reward.set_xlabel("step")
    ax_reward.set_ylabel("reward")
    ax_reward.set_title("training reward")
    ax_reward.grid(alpha=0.3)
    for key in accuracy_series(rows):
        series = [(r["step"], r[key], r.get(f"{key}_stderr", 0.0)) for r in rows if r.get(key) is not None]
        steps, values, errors = zip(*series, strict=True)
        label = key.removeprefix("eval/") + (" (± s.e.)" if any(errors) else "")
        ax_eval.errorbar(steps, values, yerr=errors, marker="s", capsize=3, label=label)
    ax_eval.set_xlabel("step")
    ax_eval.set_ylabel("accuracy")
    ax_eval.set_ylim(0, 1)
    ax_eval.set_title("evaluation accuracy")
    ax_eval.grid(alpha=0.3)
    for ax in (ax_reward, ax_eval):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps
        if ax.lines:
            ax.legend(loc="lower right")
    fig.suptitle(title or run_title(jsonl))
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    return out_path
