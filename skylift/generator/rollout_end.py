"""How a multi-turn rollout ends, shared by the text (`multi_turn.py`) and token-level
(`token_turns.py`) turn loops: untrained ids between turns, then the reward rules of a non-`stop`
ending and either one `Trajectory` or its steps (`generator.step_wise_trajectories`)."""

from __future__ import annotations

from typing import Any

from skylift.generator.step_wise import Step, step_trajectories
from skylift.generator.trajectory import Trajectory


def append_untrained(
    ids: list[int],
    response_ids: list[int],
    loss_mask: list[int],
    logprobs: list[float],
    versions: list[int] | None,
    policy_version: int,
) -> None:
    """Add `ids` after a turn without training on them (mask 0, logprob 0, the last version)."""
    response_ids += ids
    loss_mask += [0] * len(ids)
    logprobs += [0.0] * len(ids)
    if versions is not None:
        versions += [versions[-1] if versions else policy_version] * len(ids)


def finish_rollout(
    row: Any,
    s: Any,
    *,
    prompt_ids: list[int],
    response_ids: list[int],
    loss_mask: list[int],
    logprobs: list[float],
    versions: list[int] | None,
    stop_reason: str,
    turn_rewards: list[tuple[int, float]],
    turns: int,
    texts: list[str],
    steps: list[Step],
    session_id: str,
    policy_version: int,
    metadata: dict[str, Any],
    metrics: dict[str, float],
) -> list[Trajectory]:
    """The rollout's trajectory (or steps); `s` is the generator's settings."""
    if stop_reason != "stop" and s.zero_reward_on_non_stop:
        turn_rewards = [(index, 0.0) for index, _ in turn_rewards]
    total = sum(reward for _, reward in turn_rewards)
    if s.step_wise:
        return step_trajectories(
            row,
            steps,
            total,
            session_id,
            policy_version,
            overlong_filtering=s.apply_overlong_filtering,
            metadata=metadata,
            metrics=metrics,
        )
    if stop_reason != "stop" and s.apply_overlong_filtering:
        loss_mask = [0] * len(loss_mask)
    trajectory = Trajectory(
        uid=row.uid,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        loss_mask=loss_mask,
        rollout_logprobs=logprobs,
        reward=total,
        stop_reason=stop_reason,
        data_source=row.data_source,
        num_turns=turns,
        policy_version=min(versions) if versions else policy_version,
        token_versions=versions or None,
        env_metadata=metadata,
        response_text="\n".join(texts),
        turn_rewards=turn_rewards,
        metrics=metrics,
    )
    return [trajectory]
