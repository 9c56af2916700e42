"""The agent loop of one trajectory of a token-level environment (`skylift.envs.token_env`).

The environment gives the prompt as ids; each turn samples with the environment's stop condition
added to the run's, hands the sampled ids to ``step_tokens`` and appends them (trained) and then
the ids the environment put after them in the next context (untrained: `loss_mask` 0, logprob 0).
A next context that is not the previous context plus the sampled ids plus more is refused:
the environment rewrote earlier tokens, which one trajectory cannot hold (unless
``generator.step_wise_trajectories``: then each turn is its own sample, its prompt the context; or
``generator.on_template_mismatch=step_wise``: then the rollout goes on so from that turn).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from skylift.envs.token_env import TokenEnvironment, TokenPrompt, stop_fields
from skylift.generator.rollout_end import RolloutRecord, RolloutTask
from skylift.generator.rollout_errors import HistoryRewriteError, check_prompt_length
from skylift.generator.step_wise import TurnRecord
from skylift.generator.timing import TrajectoryTimer
from skylift.generator.trajectory import Trajectory
from skylift.inference.types import SamplingParams

__all__ = ["HistoryRewriteError", "run_token_turns"]


def _with_stop(params: SamplingParams, stop: Any) -> SamplingParams:
    """`params` with the environment's stop condition added to the run's."""
    fields = stop_fields(stop)
    if "stop" in fields:
        fields["stop"] = [*(params.stop or []), *fields["stop"]]
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = [*(params.stop_token_ids or []), *fields["stop_token_ids"]]
    return replace(params, **fields)


async def run_token_turns(loop: Any, timer: TrajectoryTimer, task: RolloutTask) -> list[Trajectory]:
    """One trajectory of `task`'s token-level environment (or its steps,
    `generator.step_wise_trajectories`); `loop` is the generator's `TurnLoop` (engine, settings, env
    calls), `timer` the rollout's clock."""
    s, row = loop.settings, task.row
    env: TokenEnvironment = task.env
    first: TokenPrompt = await loop.call_env(env.init_tokens, row.prompt, task.extras)
    prompt_ids = [int(t) for t in first.ids]
    check_prompt_length(row.uid, prompt_ids, s.max_prompt_length)
    stop = first.stop
    context = list(prompt_ids)
    rollout = RolloutRecord(prompt_ids, task.policy_version)
    turns: list[TurnRecord] = []  # for a switch to step-wise (generator.on_template_mismatch)
    while rollout.turns < s.max_turns:
        turn_params = rollout.turn_params(s, task.params, context, task.seed)
        if turn_params is None:
            break
        turn_params = _with_stop(turn_params, stop)
        completion, _, sampled = await loop.sample_turn(timer, rollout, s, context, turn_params, turns)
        context += sampled
        result = await timer.timed(
            "env", loop.call_env(env.step_tokens, sampled, completion.stop_reason, completion.logprobs)
        )
        rollout.add_answer(result.reward, result.metrics, result.metadata)
        if result.done:
            break
        following = [int(t) for t in result.next_ids]
        if s.step_wise:  # the next step's prompt is the environment's context, whatever it is
            context, stop = following, result.stop
            continue
        if following[: len(context)] != context and s.on_template_mismatch == "step_wise":
            s = rollout.go_step_wise(s, turns)
            context, stop = following, result.stop
            continue
        if following[: len(context)] != context:
            raise HistoryRewriteError(
                f"{type(env).__name__}: the next observation of turn {rollout.turns} does not start with "
                "the previous context and the sampled tokens (the environment rewrote earlier tokens, "
                "e.g. a renderer that strips thinking); one trajectory cannot hold it: set "
                "generator.on_template_mismatch=step_wise or generator.step_wise_trajectories=true"
            )
        rollout.add_untrained(following[len(context) :])
        context = following
        stop = result.stop
    await loop.call_env(env.close)
    return rollout.finish(row, s)
