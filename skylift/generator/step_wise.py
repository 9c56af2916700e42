"""Step-wise trajectories (`generator.step_wise_trajectories`): each turn of a rollout
becomes its own sample whose prompt is the whole context the engine was sent for that turn (the
conversation as the chat template renders it then, so templates that rewrite earlier turns, such as
Qwen3's dropping of past thinking, are trained on what the model saw) and whose response is the
turn's sampled ids. Every step carries the rollout's reward and id; the trainer computes the
advantage of each rollout's last step and gives it to all its steps (`skylift.rl.step_wise`).

`merge_steps` (``generator.merge_stepwise_output``, prefix-aware merging): where a step's
prompt + response is the start of the next step's prompt (the template did not rewrite history),
the two become one sample: the first prompt, then the responses with the tokens between them (the
turn's close and the observations) untrained. A step that does not extend the one before starts a
new sample; a merged sample is the rollout's last step when its last turn is.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from skylift.generator.routed import overlay
from skylift.generator.trajectory import Trajectory
from skylift.inference.types import Completion

#: A turn as a rollout records it for a later switch to step-wise: the length of the context sent
#: (a prefix of the rollout's ids), the engine's completion and the turn's text.
TurnRecord = tuple[int, Completion, str]


@dataclass
class Step:
    """One turn: the context sent, the sampled ids and what the engine said about them."""

    context: list[int]
    sampled: list[int]
    logprobs: list[float]
    versions: list[int] | None
    stop_reason: str
    text: str
    routed: Any = None  # routing replay: the engine's routed experts of context + sampled


def steps_of_turns(ids: list[int], turns: list[TurnRecord], engine_versions: bool) -> list[Step]:
    """The steps of the turns so far of a rollout that goes on step-wise (its template or its
    environment rewrote history: ``generator.on_template_mismatch=step_wise``); `ids`: the rollout's
    prompt and response ids, of which each turn's context is a prefix."""
    return [
        Step(
            list(ids[:length]),
            [int(t) for t in completion.token_ids],
            list(completion.logprobs or [0.0] * len(completion.token_ids)),
            completion.token_versions if engine_versions else None,
            completion.stop_reason,
            text,
            overlay(None, completion.routed_experts, length + len(completion.token_ids)),
        )
        for length, completion, text in turns
    ]


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
    merge: bool = False,
) -> list[Trajectory]:
    """One `Trajectory` per step (merged where they extend each other, with `merge`); the last
    one holds the rollout's metadata and metrics."""
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
                routed_experts=overlay(None, step.routed, len(step.context) + len(step.sampled)),
                env_metadata=dict(metadata) if last else {},
                response_text=step.text,
                metrics=dict(metrics) if last else {},
                trajectory_id=rollout_id,
                last_step=last,
            )
        )
    return merge_steps(out) if merge else out


def merge_steps(steps: list[Trajectory]) -> list[Trajectory]:
    """A rollout's steps, each merged into the one before where it extends it (see the module)."""
    merged: list[Trajectory] = []
    for step in steps:
        before = merged[-1] if merged else None
        full = before.prompt_ids + before.response_ids if before is not None else None
        if before is None or full != step.prompt_ids[: len(full)]:
            merged.append(replace(step))
            continue
        between = step.prompt_ids[len(full) :]
        versions = None
        if before.token_versions is not None and step.token_versions is not None:
            last = before.token_versions[-1] if before.token_versions else before.policy_version
            versions = before.token_versions + [last] * len(between) + step.token_versions
        merged[-1] = replace(
            step,
            prompt_ids=before.prompt_ids,
            response_ids=before.response_ids + between + step.response_ids,
            loss_mask=before.loss_mask + [0] * len(between) + step.loss_mask,
            rollout_logprobs=before.rollout_logprobs + [0.0] * len(between) + step.rollout_logprobs,
            policy_version=min(before.policy_version, step.policy_version),
            token_versions=versions,
            # the step's request held the sample before it: its routing covers those ids too
            routed_experts=overlay(
                before.routed_experts, step.routed_experts, len(step.prompt_ids) + len(step.response_ids)
            ),
            response_text=before.response_text + "\n" + step.response_text,
        )
    return merged
