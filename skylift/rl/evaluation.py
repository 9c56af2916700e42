"""Evaluation: greedy (or `eval_sampling_params`) accuracy on the held-out prompts, with its standard
error, and pass@n and majority voting when each prompt is sampled n > 1 times
(skylift.utils.eval_stats)."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.utils.eval_stats import Sample, accuracy_figures


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
    groups: dict[str, list[Sample]] = defaultdict(list)  # the samples of each prompt
    sources: dict[str, set[str]] = defaultdict(set)
    for tr in trajectories:
        groups[tr.uid].append(Sample(tr.reward, answer_of(tr)))
        sources[tr.data_source or "all"].add(tr.uid)
    metrics: dict[str, float] = {}
    for src, uids in sources.items():
        metrics.update(accuracy_figures([groups[u] for u in sorted(uids)], f"eval/{src}/"))
    metrics.update(accuracy_figures(list(groups.values()), "eval/"))
    metrics["eval/response_length"] = statistics.fmean(tr.num_generated_tokens for tr in trajectories)
    metrics["timing/eval_s"] = time.perf_counter() - tick
    return metrics, trajectories


def answer_of(tr: Trajectory) -> str | None:
    """The answer majority voting counts: the environment's parsed answer when it reports one
    (None: no answer found), else the whole response text, stripped."""
    if "parsed_answer" in tr.env_metadata:
        answer = tr.env_metadata["parsed_answer"]
        return None if answer is None else str(answer)
    return tr.response_text.strip()


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
