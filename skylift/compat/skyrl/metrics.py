"""SkyRL's figures of a batch under SkyRL's names, a metrics plugin of `skylift.generator.metrics`.

`skyrl_generate_metrics`: SkyRL's token statistics of a batch (``generate/*``) and its rollouts'
wall-clock figures (`trajectory_time_metrics`), logged under SkyRL's names by training steps and, as
``eval/all/generate/*``, by evaluations.
`group_completion_metrics`: SkyRL's fully async figures of the prompt groups a step consumed
(``generate/group_completion_time_*``, ``generate/intra_group_completion_time_*``). SkyRL also
logs them for the groups its fully async trainer dropped (``generate_kept/``,
``generate_dropped/``, `dropped_group_metrics`), and with `trainer.fully_async.sample_full_batch`
``async/num_groups_dropped`` and ``async/keep_rate`` (`keep_rate_metrics`).
`skyrl_eval_figures`: SkyRL's evaluation figures (``eval/all/avg_score``, ``eval/all/pass_at_<n>``,
``eval/all/mean_positive_reward`` and their ``eval/<data_source>/`` counterparts, `skyrl_figures`),
so SkyRL users' dashboards carry over.
`skyrl_metrics` is the plugin (registered into `skylift.generator.metrics.METRICS` on import).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

import torch

from skylift.generator.metrics import METRICS, GroupTimes, MetricsRequest, TimedGroup
from skylift.generator.trajectory import Trajectory


def skyrl_generate_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """SkyRL's ``generate/*`` figures of a batch, with its meanings: ``num_tokens`` counts every
    response token (observations between turns too), ``assistant_tokens`` the trained ones, and a
    turn is a run of trained tokens; populations' standard deviations; ``avg_tokens_non_zero_rewards``
    / ``avg_tokens_zero_rewards`` over the rewards > 0 / == 0 (0 when there are none)."""
    if not trajectories:
        return {}
    tokens = [len(tr.response_ids) for tr in trajectories]
    assistant = [tr.num_generated_tokens for tr in trajectories]
    positive = [n for n, tr in zip(tokens, trajectories, strict=True) if tr.reward > 0]
    zero = [n for n, tr in zip(tokens, trajectories, strict=True) if tr.reward == 0]
    metrics = {
        **_spread("generate/{}_num_tokens", tokens),
        "generate/avg_tokens_non_zero_rewards": statistics.fmean(positive) if positive else 0.0,
        "generate/avg_tokens_zero_rewards": statistics.fmean(zero) if zero else 0.0,
        **_spread("generate/{}_assistant_tokens", assistant),
    }
    turns = [run for tr in trajectories for run in _trained_runs(tr.loss_mask)]
    if turns:
        metrics["generate/tokens_per_turn_mean"] = statistics.fmean(turns)
        metrics["generate/tokens_per_turn_std"] = statistics.pstdev(turns)
        metrics["generate/tokens_per_turn_max"] = float(max(turns))
    return {**metrics, **trajectory_time_metrics(trajectories)}


def trajectory_time_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """SkyRL's ``generate/trajectory_time_<name>_{mean,p90,max}`` over the batch's rollouts (one per
    rollout: a step-wise rollout counts by its last step), from their `Trajectory.timing`
    (`skylift.generator.timing`): ``completion`` (each rollout's wall-clock seconds), its splits
    ``llm`` (awaiting the engine) and ``env`` (the environment's steps), and ``other`` (completion
    less the splits: prompt rendering, tokenisation, the environment's ``init``/``close``). As in
    SkyRL, a figure is left out when a rollout did not record it; p90 interpolates linearly (numpy's
    default)."""
    ends = [tr.timing for tr in trajectories if tr.last_step]
    if not ends:
        return {}
    metrics: dict[str, float] = {}
    completion = [t["completion"] for t in ends] if all("completion" in t for t in ends) else None
    names = [name for name in ends[0] if name != "completion"]
    splits = {name: [t[name] for t in ends] for name in names if all(name in t for t in ends)}
    if completion is not None:
        metrics.update(_time_stats("completion", completion))
    for name, times in splits.items():
        metrics.update(_time_stats(name, times))
    if completion is not None and splits:
        other = [total - sum(times[i] for times in splits.values()) for i, total in enumerate(completion)]
        metrics.update(_time_stats("other", other))
    return metrics


def intra_group_completion_spread(group: Sequence[Trajectory]) -> tuple[float | None, float | None]:
    """SkyRL's `get_intra_group_completion_time_std_cv` of one prompt group: the population standard
    deviation of its rollouts' completion seconds (`Trajectory.timing`; a step-wise rollout by its
    last step) and its coefficient of variation (std / mean; None when the mean is not positive).
    (None, None) when a rollout did not record its time or the group has fewer than two samples;
    as in SkyRL, a step-wise group's samples are its steps, so one rollout of several steps gives 0."""
    if len(group) < 2:
        return None, None
    ends = [tr.timing.get("completion") for tr in group if tr.last_step]
    times = [t for t in ends if t is not None]
    if not times or len(times) < len(ends):
        return None, None
    std, mean = statistics.pstdev(times), statistics.fmean(times)
    return std, (std / mean if mean > 0 else None)


def group_completion_metrics(groups: Sequence[TimedGroup]) -> dict[str, float]:
    """SkyRL's `get_group_completion_metrics` over a step's prompt groups:
    ``generate/group_completion_time_{mean,p90,max}`` of the groups' completion seconds (those
    measured) and the means of their `intra_group_completion_spread`,
    ``generate/intra_group_completion_time_{std,cv}_mean``; each left out when it has no value.
    p90 interpolates linearly (numpy's default)."""
    times = [seconds for _, seconds in groups if seconds is not None]
    spreads = [intra_group_completion_spread(group) for group, _ in groups]
    stds = [std for std, _ in spreads if std is not None]
    cvs = [cv for _, cv in spreads if cv is not None]
    metrics: dict[str, float] = {}
    if times:
        metrics["generate/group_completion_time_mean"] = statistics.fmean(times)
        metrics["generate/group_completion_time_p90"] = _p90(times)
        metrics["generate/group_completion_time_max"] = float(max(times))
    if stds:
        metrics["generate/intra_group_completion_time_std_mean"] = statistics.fmean(stds)
    if cvs:
        metrics["generate/intra_group_completion_time_cv_mean"] = statistics.fmean(cvs)
    return metrics


def _p90(values: Sequence[float]) -> float:
    return float(torch.quantile(torch.tensor(values, dtype=torch.float64), 0.9))  # linear, as numpy


def _time_stats(name: str, times: Sequence[float]) -> dict[str, float]:
    return {
        f"generate/trajectory_time_{name}_mean": statistics.fmean(times),
        f"generate/trajectory_time_{name}_p90": _p90(times),
        f"generate/trajectory_time_{name}_max": float(max(times)),
    }


def _spread(name: str, values: Sequence[int]) -> dict[str, float]:
    return {
        name.format("min"): float(min(values)),
        name.format("max"): float(max(values)),
        name.format("avg"): statistics.fmean(values),
        name.format("std"): statistics.pstdev(values),
    }


def _trained_runs(mask: Sequence[int]) -> list[int]:
    """The lengths of the runs of non-zero entries of `mask` (a multi-turn rollout's turns)."""
    runs, current = [], 0
    for bit in mask:
        if bit:
            current += 1
        elif current:
            runs.append(current)
            current = 0
    return runs + [current] if current else runs


def reprefixed(metrics: dict[str, float], view: str) -> dict[str, float]:
    """SkyRL's separate views of a figure: ``generate/X`` -> ``generate_<view>/X``."""
    out: dict[str, float] = {}
    for key, value in metrics.items():
        prefix, sep, rest = key.partition("/")
        out[f"{prefix}_{view}/{rest}" if sep else f"{view}/{key}"] = value
    return out


def dropped_group_metrics(
    kept: Sequence[TimedGroup], dropped: Sequence[TimedGroup], n_samples: int
) -> dict[str, float]:
    """SkyRL's figures of a fully async step whose batch-filling dropped groups
    (`trainer.fully_async.sample_full_batch`): ``generate/group_completion_*`` over kept and dropped
    groups, ``generate_kept/*`` and ``generate_dropped/*`` over each, and the dropped groups'
    rewards (``reward_dropped/avg_pass_at_<n>``: groups with a positive reward,
    ``avg_raw_reward``, ``mean_positive_reward``)."""
    rewards = [tr.reward for group, _ in dropped for tr in group]
    metrics = group_completion_metrics([*kept, *dropped])
    metrics |= reprefixed(group_completion_metrics(kept), "kept")
    metrics |= reprefixed(group_completion_metrics(dropped), "dropped")
    if rewards:
        passed = sum(any(tr.reward > 0 for tr in group) for group, _ in dropped)
        metrics[f"reward_dropped/avg_pass_at_{n_samples}"] = passed / len(dropped)
        metrics["reward_dropped/avg_raw_reward"] = statistics.fmean(rewards)
        metrics["reward_dropped/mean_positive_reward"] = statistics.fmean(max(r, 0.0) for r in rewards)
    return metrics


def skyrl_figures(groups: Sequence[Sequence[float]], prefix: str, n: int) -> dict[str, float]:
    """SkyRL's evaluation figures of each prompt's rewards `groups`, under SkyRL's names:
    `{prefix}avg_score` (mean reward over all samples), `{prefix}pass_at_{n}` (share of prompts
    with a positive reward among their samples) and `{prefix}mean_positive_reward` (mean of the
    rewards clipped at 0). `n` is the configured samples per prompt (SkyRL names the key after it,
    also for n = 1)."""
    groups = [g for g in groups if g]
    if not groups:
        return {}
    rewards = [r for g in groups for r in g]
    return {
        f"{prefix}avg_score": statistics.fmean(rewards),
        f"{prefix}pass_at_{n}": sum(1 for g in groups if any(r > 0 for r in g)) / len(groups),
        f"{prefix}mean_positive_reward": statistics.fmean(max(r, 0.0) for r in rewards),
    }


def skyrl_source_name(data_source: str | None) -> str:
    """A data source as SkyRL writes it in metric names: "unknown" when unset, "/" as "_"."""
    return "unknown" if not data_source else data_source.replace("/", "_")


def skyrl_eval_figures(trajectories: Sequence[Trajectory], n_samples: int | None) -> dict[str, float]:
    """`skyrl_figures` of an evaluation's samples (grouped by prompt uid) per data source, under
    ``eval/<skyrl_source_name>/``, then over all of them, under ``eval/all/``. `n_samples`: the
    configured samples per prompt (SkyRL's `<n>`; None: the most samples any prompt got)."""
    groups: dict[str, list[float]] = defaultdict(list)  # the rewards of each prompt's samples
    sources: dict[str | None, list[str]] = defaultdict(list)  # the prompts of each data source
    for tr in trajectories:
        if tr.uid not in groups:
            sources[tr.data_source or None].append(tr.uid)
        groups[tr.uid].append(tr.reward)
    if not groups:
        return {}
    n = n_samples or max(len(g) for g in groups.values())
    metrics: dict[str, float] = {}
    for source, uids in sources.items():
        metrics.update(skyrl_figures([groups[u] for u in uids], f"eval/{skyrl_source_name(source)}/", n))
    metrics.update(skyrl_figures(list(groups.values()), "eval/all/", n))
    return metrics


def keep_rate_metrics(groups: GroupTimes) -> dict[str, float]:
    """SkyRL's figures of `trainer.fully_async.sample_full_batch` (none without it):
    ``async/num_groups_dropped``, the groups turned down while the step's batch filled, and
    ``async/keep_rate``, the batch's groups over those and the turned-down ones."""
    if not groups.filtered:
        return {}
    batch, turned_down = len(groups.kept), len(groups.dropped)
    return {"async/num_groups_dropped": float(turned_down), "async/keep_rate": batch / (batch + turned_down)}


@METRICS.register
def skyrl_metrics(request: MetricsRequest) -> dict[str, float]:
    """The plugin: a batch's ``generate/*`` figures (for an evaluation, `skyrl_eval_figures` and
    ``eval/all/generate/*``), or a fully async step's group figures (SkyRL's kept and dropped views
    when groups were dropped)."""
    groups = request.groups
    if groups is not None:
        if groups.dropped:  # sample_full_batch dropped groups while this batch filled: SkyRL's views
            figures = dropped_group_metrics(groups.kept, groups.dropped, groups.n_samples)
        else:
            figures = group_completion_metrics(groups.kept)
        return {**figures, **keep_rate_metrics(groups)}
    figures = skyrl_generate_metrics(request.trajectories)
    if not request.evaluation:
        return figures
    generate = {f"eval/all/{k}": v for k, v in figures.items()}
    return {**skyrl_eval_figures(request.trajectories, request.n_samples), **generate}
