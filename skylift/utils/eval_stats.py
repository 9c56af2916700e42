"""Accuracy figures people can compare: the mean reward with its standard error, pass@n and
majority voting (maj@n) over the samples of each prompt. Other figures of an evaluation come from
the metrics plugins (`skylift.generator.metrics.plugin_metrics`).

Every figure is a mean over prompts of a per-prompt score, and its standard error treats the
prompts as the independent draws: ``sqrt(var / P)`` with the population variance of the per-prompt
scores over P prompts. With one 0/1 reward per prompt that is the binomial ``sqrt(p (1 - p) / n)``;
with several samples per prompt it accounts for their correlation (samples of one prompt are not
independent evidence about the model's accuracy).
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    """One response to a prompt: its reward and the answer it gave (None: no answer found)."""

    reward: float
    answer: Hashable | None = None


def standard_error(scores: Sequence[float]) -> float:
    """Standard error of the mean of independent per-prompt `scores` (0 for fewer than 2)."""
    if len(scores) < 2:
        return 0.0
    return math.sqrt(statistics.pvariance(scores) / len(scores))


def majority_score(samples: Sequence[Sample]) -> float:
    """The reward of the most frequent answer among `samples` (mean over the samples giving it);
    a tie goes to the answer given first; 0 when no sample gave an answer."""
    answers = [s.answer for s in samples if s.answer is not None]
    if not answers:
        return 0.0
    counts = Counter(answers)
    top = max(counts.values())
    winner = next(a for a in answers if counts[a] == top)
    return statistics.fmean(s.reward for s in samples if s.answer == winner)


def accuracy_figures(groups: Sequence[Sequence[Sample]], prefix: str) -> dict[str, float]:
    """`{prefix}accuracy` (mean reward over all samples, i.e. pass@1 averaged over the samples)
    and its `_stderr`; with more than one sample per prompt also `{prefix}pass@n` (best reward
    of a prompt's n samples) and `{prefix}maj@n` (`majority_score`), each with its `_stderr`.
    `groups` holds each prompt's samples; n is the largest group."""
    groups = [g for g in groups if g]
    if not groups:
        return {}
    means = [statistics.fmean(s.reward for s in g) for g in groups]
    total = sum(len(g) for g in groups)
    figures = {
        f"{prefix}accuracy": sum(s.reward for g in groups for s in g) / total,
        f"{prefix}accuracy_stderr": standard_error(means),
    }
    n = max(len(g) for g in groups)
    if n > 1:
        for name, scores in (
            (f"pass@{n}", [max(s.reward for s in g) for g in groups]),
            (f"maj@{n}", [majority_score(g) for g in groups]),
        ):
            figures[f"{prefix}{name}"] = statistics.fmean(scores)
            figures[f"{prefix}{name}_stderr"] = standard_error(scores)
    return figures


def format_accuracy(value: float, stderr: float) -> str:
    """``'70% ± 4.6'``: a fraction as a percentage with its standard error in points."""
    return f"{value:.0%} ± {100 * stderr:.1f}"


__all__ = [
    "Sample",
    "accuracy_figures",
    "format_accuracy",
    "majority_score",
    "standard_error",
]
