"""What the trainer logs of a batch's trajectories, and their per-turn rewards as a tensor.

`turn_reward_tensor` puts each turn's reward on that turn's last sampled token (the estimators
that walk tokens, GAE and REINFORCE++, then credit each turn with what came after it; GRPO and
RLOO sum a row's token rewards, which gives back the trajectory's reward).
`rollout_metrics`: per-turn reward means (``reward/turn_<t>_mean`` over the trajectories that
reached turn t), turns per trajectory, and the means of the environments' step metrics
(``env/<name>``, e.g. ``env/tool_calls`` per trajectory); per environment class (when the batch's
trajectories name theirs), ``environment/<env_class>/reward_mean`` and its episodes' metrics
(``env_metadata["env_metrics"]``, e.g. what a gym-style env's ``get_metrics`` returns) combined by
the environment's factory (`skylift.envs.registry.aggregate_episode_metrics`),
``environment/<env_class>/<key>``, e.g. ``environment/gsm8k_multi_turn/avg_steps``; with one
environment class in the batch also as ``environment/<key>``.
`plugin_metrics`: the figures of the metrics plugins (`METRICS`, a hook point; the built-in one
is named here and imported by name) for a training step's batch, an evaluation's, or a fully async
step's prompt groups (`MetricsRequest`).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from skylift.envs.registry import aggregate_episode_metrics
from skylift.generator.trajectory import Trajectory
from skylift.utils.hooks import Hook

#: Per-turn reward means are logged for the first this many turns.
MAX_LOGGED_TURNS = 8


def turn_reward_tensor(trajectories: Sequence[Trajectory], response_mask: Tensor) -> Tensor | None:
    """`[batch, response_len]` rewards with each turn's reward on its last sampled token, or None
    when no trajectory has per-turn rewards (then the sequence rewards are used as they are).

    A turn whose token is masked out (overlong filtering) gives its reward to the nearest trained
    token before it, else after it; a row without a trained token gets no reward (as on the
    sequence level).
    """
    if not any(len(tr.turn_rewards) > 1 for tr in trajectories):
        return None
    out = torch.zeros(response_mask.shape, dtype=torch.float32)
    for row, tr in enumerate(trajectories):
        valid = torch.nonzero(response_mask[row] != 0).flatten().tolist()
        if not valid:
            continue
        pairs = tr.turn_rewards or [(len(tr.response_ids) - 1, tr.reward)]
        for index, reward in pairs:
            before = [i for i in valid if i <= index]
            out[row, before[-1] if before else valid[0]] += reward
    return out


def rollout_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Per-turn reward means, turns per trajectory and the environments' metrics (means)."""
    metrics: dict[str, float] = {}
    if not trajectories:
        return metrics
    if any(tr.turn_rewards for tr in trajectories):
        metrics["rollout/turns_mean"] = statistics.fmean(tr.num_turns for tr in trajectories)
        for turn in range(MAX_LOGGED_TURNS):
            rewards = [tr.turn_rewards[turn][1] for tr in trajectories if len(tr.turn_rewards) > turn]
            if rewards:
                metrics[f"reward/turn_{turn + 1}_mean"] = statistics.fmean(rewards)
    names = sorted({name for tr in trajectories for name in tr.metrics})
    for name in names:
        metrics[f"env/{name}"] = statistics.fmean(tr.metrics.get(name, 0.0) for tr in trajectories)
    metrics.update(per_environment_metrics(trajectories))
    return metrics


def per_environment_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Reward means and aggregated episode metrics per environment class (see the module)."""
    by_env: dict[str, list[Trajectory]] = {}
    for tr in trajectories:
        if tr.env_class and tr.last_step:  # a step-wise rollout counts once, by its last step
            by_env.setdefault(tr.env_class, []).append(tr)
    metrics: dict[str, float] = {}
    for env_class, group in sorted(by_env.items()):
        metrics[f"environment/{env_class}/reward_mean"] = statistics.fmean(tr.reward for tr in group)
        episodes = [tr.env_metadata["env_metrics"] for tr in group if tr.env_metadata.get("env_metrics")]
        if not episodes:
            continue
        aggregated = aggregate_episode_metrics(env_class, episodes)
        metrics.update({f"environment/{env_class}/{key}": value for key, value in aggregated.items()})
        if len(by_env) == 1:
            metrics.update({f"environment/{key}": value for key, value in aggregated.items()})
    return metrics


#: a prompt group's rollouts with its completion seconds (None: not measured)
TimedGroup = tuple[Sequence[Trajectory], float | None]


@dataclass(frozen=True)
class GroupTimes:
    """A fully async step's prompt groups: those it trains on and those its batch-filling dropped."""

    kept: Sequence[TimedGroup]
    dropped: Sequence[TimedGroup]
    n_samples: int  # samples per prompt
    #: groups were turned down as they finished (`trainer.fully_async.sample_full_batch`): `dropped`
    #: holds those turned down while this step's batch filled
    filtered: bool = False


@dataclass(frozen=True)
class MetricsRequest:
    """What a metrics plugin is asked for: a batch's figures (a training step's, or with
    `evaluation` an evaluation's, named as the plugin logs those), or with `groups` a fully async
    step's prompt groups'."""

    trajectories: Sequence[Trajectory] = ()
    evaluation: bool = False
    groups: GroupTimes | None = None
    n_samples: int | None = None  # an evaluation's samples per prompt (None: the most any prompt got)


METRICS: Hook[Callable[[MetricsRequest], dict[str, float]]] = Hook(
    "metrics plugin", ("skylift.compat.skyrl.metrics",)
)


def plugin_metrics(request: MetricsRequest) -> dict[str, float]:
    """The figures every registered metrics plugin gives for `request`, merged."""
    out: dict[str, float] = {}
    for plugin in METRICS.items():
        out.update(plugin(request))
    return out
