"""Step-wise trajectories (`generator.step_wise_trajectories`, as SkyRL's): each turn of a rollout
becomes its own sample whose prompt is the whole context the engine was sent for that turn (the
conversation as the chat template renders it then, so templates that rewrite earlier turns, such as
Qwen3's dropping of past thinking, are trained on what the model saw) and whose response is the
turn's sampled ids. Every step carries the rollout's reward and id; the trainer computes the
advantage of each rollout's last step and gives it to all its steps (`skylift.rl.step_wise`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skylift.generator.trajectory import Trajectory


@dataclass
class Step:
    """One turn: the context sent, the sampled ids and what the engine said about them."""

    context: list[int]
    sampled: list[int]
    logprobs: list[float]
    versions: list[int] | None
    stop_reason: str
    text: str


def step_trajectories(
    row: Any,
    steps: list[Step],
    reward: float,
    rollout_id: str,
    policy_version: int,
    *,
    overlong_filtering: bool,
    metadata: dict[str, Any],
    metrics: dict[str, float],
) -> list[Trajectory]:
    """One `Trajectory` per step; the last one holds the rollout's metadata and metrics."""
    out = []
    for k, step in enumerate(steps):
        last = k == len(steps) - 1
        masked = overlong_filtering and step.stop_reason != "stop"
        out.append(
            Trajectory(
                uid=row.uid,
                prompt_ids=list(step.context),
                response_ids=list(step.sampled),
                loss_mask=[0 if masked else 1] * len(step.sampled),
                rollout_logprobs=list(step.logprobs),
                reward=reward,
                stop_reason=step.stop_reason,
                data_source=row.data_source,
                num_turns=len(steps),
                policy_version=min(step.versions) if step.versions else policy_version,
                token_versions=step.versions or None,
                env_metadata=dict(metadata) if last else {},
                response_text=step.text,
                metrics=dict(metrics) if last else {},
                trajectory_id=rollout_id,
                last_step=last,
            )
        )
    return out
