"""Evaluation: greedy (or `eval_sampling_params`) accuracy on the held-out prompts."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from skylift.data import PromptSample
from skylift.generator import Trajectory


def evaluate(
    rows: Sequence[PromptSample],
    generate: Callable[[list[PromptSample]], list[Trajectory]],
    batch_size: int,
) -> tuple[dict[str, float], list[Trajectory]]:
    """Metrics (accuracy overall and per data source, response length, time) and the trajectories,
    generated `batch_size` prompts at a time."""
    tick = time.perf_counter()
    rows = list(rows)
    trajectories: list[Trajectory] = []
    for start in range(0, len(rows), batch_size):
        trajectories += generate(rows[start : start + batch_size])
    by_source: dict[str, list[float]] = defaultdict(list)
    for tr in trajectories:
        by_source[tr.data_source or "all"].append(tr.reward)
    metrics = {f"eval/{src}/accuracy": statistics.fmean(v) for src, v in by_source.items()}
    metrics["eval/accuracy"] = statistics.fmean(tr.reward for tr in trajectories)
    metrics["eval/response_length"] = statistics.fmean(tr.num_generated_tokens for tr in trajectories)
    metrics["timing/eval_s"] = time.perf_counter() - tick
    return metrics, trajectories


def dump_eval(path: Path, trajectories: Sequence[Trajectory]) -> None:
    """One JSON line per trajectory: uid, response text, reward, stop reason."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for tr in trajectories:
            row = {
                "uid": tr.uid,
                "response": tr.response_text,
                "reward": tr.reward,
                "stop_reason": tr.stop_reason,
            }
            f.write(json.dumps(row) + "\n")
