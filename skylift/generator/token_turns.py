"""The agent loop of one trajectory of a token-level environment (`skylift.envs.token_env`).

The environment gives the prompt as ids; each turn samples with the environment's stop condition
added to the run's, hands the sampled ids to ``step_tokens`` and appends them (trained) and then
the ids the environment put after them in the next context (untrained: `loss_mask` 0, logprob 0).
A next context that is not the previous context plus the sampled ids plus more is refused:
the environment rewrote earlier tokens, which one trajectory cannot hold (unless
``generator.step_wise_trajectories``: then each turn is its own sample, its prompt the context).
"""

from __future__ import annotations

import uuid
from dataclasses import replace
from typing import Any

from skylift.envs.token_env import TokenEnvironment, TokenPrompt, stop_fields
from skylift.generator.rollout_end import append_untrained, finish_rollout
from skylift.generator.settings import TURN_SEED_STRIDE
from skylift.generator.step_wise import Step
from skylift.generator.trajectory import Trajectory
from skylift.inference.types import SamplingParams


class HistoryRewriteError(ValueError):
    """A token-level environment's next context does not extend the previous one."""


def _turn_params(params: SamplingParams, stop: Any, budget: int, seed: int | None) -> SamplingParams:
    fields = stop_fields(stop)
    if "stop" in fields:
        fields["stop"] = [*(params.stop or []), *fields["stop"]]
    if "stop_token_ids" in fields:
        fields["stop_token_ids"] = [*(params.stop_token_ids or []), *fields["stop_token_ids"]]
    return replace(params, max_tokens=budget, seed=seed, **fields)


async def run_token_turns(
    loop: Any,
    row: Any,
    env: TokenEnvironment,
    extras: dict[str, Any],
    params: SamplingParams,
    policy_version: int,
    seed: int | None,
) -> list[Trajectory]:
    """One trajectory of `env` (or its steps, `generator.step_wise_trajectories`); `loop` is the
    generator's `TurnLoop` (engine, settings, env calls)."""
    s = loop.settings
    first: TokenPrompt = await loop.call_env(env.init_tokens, row.prompt, extras)
    prompt_ids = [int(t) for t in first.ids]
    if len(prompt_ids) > s.max_prompt_length:
        raise ValueError(
            f"prompt {row.uid} has {len(prompt_ids)} tokens, more than max_prompt_length={s.max_prompt_length}"
        )
    stop = first.stop
    context = list(prompt_ids)
    session_id = uuid.uuid4().hex
    max_total = s.max_input_length or (s.max_prompt_length + s.max_generate_length * s.max_turns)
    response_ids: list[int] = []
    loss_mask: list[int] = []
    logprobs: list[float] = []
    texts: list[str] = []
    turn_rewards: list[tuple[int, float]] = []
    metrics: dict[str, float] = {}
    metadata: dict[str, Any] = {}
    versions: list[int] | None = []
    stop_reason, turns = "length", 0
    steps: list[Step] = []
    while turns < s.max_turns:
        budget = min(params.max_tokens, s.max_generate_length, max_total - len(context))
        if budget <= 0:
            stop_reason = "length"
            break
        turn_seed = None if seed is None else seed + turns * TURN_SEED_STRIDE
        turn_params = _turn_params(params, stop, budget, turn_seed)
        out = await loop.engine.generate([context], turn_params, session_id)
        completion = await loop.resubmit(context, out[0].completions[0], turn_params, session_id)
        turns += 1
        sampled = [int(t) for t in completion.token_ids]
        if versions is not None and completion.token_versions is not None and s.engine_versions:
            versions += completion.token_versions
        else:
            versions = None
        sampled_logprobs = list(completion.logprobs or [0.0] * len(sampled))
        text = loop.chat.tokenizer.decode(sampled, skip_special_tokens=True)
        if s.step_wise:
            turn_versions = completion.token_versions if s.engine_versions else None
            steps.append(
                Step(list(context), sampled, sampled_logprobs, turn_versions, completion.stop_reason, text)
            )
        response_ids += sampled
        loss_mask += [1] * len(sampled)
        logprobs += sampled_logprobs
        context += sampled
        texts.append(text)
        stop_reason = completion.stop_reason
        result = await loop.call_env(env.step_tokens, sampled, stop_reason, completion.logprobs)
        turn_rewards.append((len(response_ids) - 1, float(result.reward)))
        for name, value in (result.metrics or {}).items():
            metrics[name] = metrics.get(name, 0.0) + float(value)
        metadata = dict(result.metadata)
        if result.done:
            break
        following = [int(t) for t in result.next_ids]
        if s.step_wise:  # the next step's prompt is the environment's context, whatever it is
            context, stop = following, result.stop
            continue
        if following[: len(context)] != context:
            raise HistoryRewriteError(
                f"{type(env).__name__}: the next observation of turn {turns} does not start with the "
                "previous context and the sampled tokens (the environment rewrote earlier tokens, e.g. "
                "a renderer that strips thinking); one trajectory cannot hold it: set "
                "generator.step_wise_trajectories=true"
            )
        append_untrained(
            following[len(context) :], response_ids, loss_mask, logprobs, versions, policy_version
        )
        context = following
        stop = result.stop
    await loop.call_env(env.close)
    return finish_rollout(
        row,
        s,
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        loss_mask=loss_mask,
        logprobs=logprobs,
        versions=versions,
        stop_reason=stop_reason,
        turn_rewards=turn_rewards,
        turns=turns,
        texts=texts,
        steps=steps,
        session_id=session_id,
        policy_version=policy_version,
        metadata=metadata,
        metrics=metrics,
    )
