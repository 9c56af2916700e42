"""Evaluation: greedy (or `eval_sampling_params`) accuracy on the held-out prompts, with its standard
error, and pass@n and majority voting when each prompt is sampled n > 1 times (skylift.utils.eval_stats);
the metrics plugins' figures of the evaluation beside them (`skylift.generator.metrics.plugin_metrics`).
The training loop and the eval-only command (`skylift eval`, `skylift.rl.eval_only`) both evaluate here."""

from __future__ import annotations

import json
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path

from skylift.data import PromptSample
from skylift.generator import Trajectory
from skylift.generator.metrics import MetricsRequest, plugin_metrics, rollout_metrics
from skylift.utils.eval_stats import Sample, accuracy_figures


def evaluate(
    rows: Sequence[PromptSample],
    generate: Callable[[list[PromptSample]], list[Trajectory]],
    batch_size: int,
    n_samples: int | None = None,
) -> tuple[dict[str, float], list[Trajectory]]:
    """Metrics and the trajectories, generated `batch_size` prompts at a time. The metrics, overall
    and per data source (rows without one count as "unknown"): skylift's accuracy with its standard
    error (and pass@n / maj@n); then the response length, the multi-turn figures of
    `rollout_metrics` (`eval/env/<name>`: the means of the environments' step metrics, e.g.
    `eval/env/tool_calls`), the metrics plugins' figures of the evaluation (`plugin_metrics`, e.g.
    `eval/all/avg_score`, `eval/all/pass_at_<n>`, `eval/all/generate/*`) and the times:
    `timing/eval_s` (all of it) and `timing/eval_generate` (the generation, environments' scoring
    included). `n_samples`: the configured samples per prompt (default: the most samples any prompt
    got)."""
    tick = time.perf_counter()
    rows = list(rows)
    trajectories: list[Trajectory] = []
    for start in range(0, len(rows), batch_size):
        trajectories += generate(rows[start : start + batch_size])
    generated = time.perf_counter() - tick  # timing/eval_generate
    if not trajectories:
        return {"timing/eval_s": generated, "timing/eval_generate": generated}, trajectories
    groups: dict[str, list[Trajectory]] = defaultdict(list)  # the samples of each prompt
    sources: dict[str | None, list[str]] = defaultdict(list)  # the prompts of each data source
    for tr in trajectories:
        if tr.uid not in groups:
            sources[tr.data_source or None].append(tr.uid)
        groups[tr.uid].append(tr)
    n = n_samples or max(len(g) for g in groups.values())

    def figures(uids: Sequence[str], prefix: str) -> dict[str, float]:
        return accuracy_figures(
            [[Sample(tr.reward, answer_of(tr)) for tr in groups[u]] for u in uids], prefix
        )

    metrics: dict[str, float] = {}
    for src, uids in sources.items():
        metrics.update(figures(uids, f"eval/{src or 'unknown'}/"))
    metrics.update(figures(list(groups), "eval/"))
    metrics["eval/response_length"] = statistics.fmean(tr.num_generated_tokens for tr in trajectories)
    metrics.update({f"eval/{name}": value for name, value in rollout_metrics(trajectories).items()})
    metrics.update(plugin_metrics(MetricsRequest(trajectories, evaluation=True, n_samples=n)))
    metrics["timing/eval_generate"] = generated
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
    """One JSON line per trajectory: uid, data source, response text, reward, stop reason."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for tr in trajectories:
            row = {
                "uid": tr.uid,
                "data_source": tr.data_source,
                "response": tr.response_text,
                "reward": tr.reward,
                "stop_reason": tr.stop_reason,
            }
            f.write(json.dumps(row) + "\n")
