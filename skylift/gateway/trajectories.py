"""A gateway session's calls -> the rollout's trajectories.

One step per call (`skylift.generator.step_wise.Step`): its prompt the ids the chat template
rendered for that call, its response exactly the sampled ids (never the agent's text
re-tokenised), loss only on them; every step carries the rollout's reward and id. A call whose
prompt starts with the previous call's prompt + sampled ids is merged into it (one sequence, the
ids in between untrained). A session ended by its budget has its last step marked ``length``
(so ``generator.zero_reward_on_non_stop`` and ``apply_overlong_filtering`` apply). A rollout
without any call becomes one stand-in sample (the row's prompt, one untrained end-of-turn token)
that keeps its place in the group and trains nothing.
"""

from __future__ import annotations

from typing import Any

from skylift.gateway.session import Session
from skylift.generator.step_wise import Step, step_trajectories
from skylift.generator.trajectory import Trajectory


def session_trajectories(
    row: Any,
    session: Session,
    reward: float,
    rollout_id: str,
    *,
    stand_in_prompt: list[int],
    stand_in_token: int,
    zero_reward_on_non_stop: bool = False,
    overlong_filtering: bool = False,
    metadata: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
) -> list[Trajectory]:
    metadata = dict(metadata or {})
    if session.stop_reason is not None:
        metadata["gateway_stop"] = session.stop_reason
    steps = [
        Step(
            context=list(call.prompt_ids),
            sampled=list(call.sampled_ids),
            logprobs=list(call.logprobs),
            versions=call.token_versions,
            stop_reason="stop" if call.finish_reason == "stop" else "length",
            text=call.text,
            routed=call.routed_experts,
        )
        for call in session.calls
    ]
    if steps and session.stop_reason is not None:
        steps[-1].stop_reason = "length"
    if zero_reward_on_non_stop and (not steps or steps[-1].stop_reason != "stop"):
        reward = 0.0
    if not steps:
        return [
            Trajectory(
                uid=row.uid,
                prompt_ids=list(stand_in_prompt),
                response_ids=[stand_in_token],
                loss_mask=[0],
                rollout_logprobs=[0.0],
                reward=reward,
                stop_reason="stop",
                data_source=row.data_source,
                num_turns=0,
                policy_version=session.policy_version,
                env_metadata=metadata,
                metrics=dict(metrics or {}),
                trajectory_id=rollout_id,
                last_step=True,
            )
        ]
    return step_trajectories(
        row,
        steps,
        reward,
        rollout_id,
        session.policy_version,
        overlong_filtering=overlong_filtering,
        metadata=metadata,
        metrics=dict(metrics or {}),
        merge=True,
    )
