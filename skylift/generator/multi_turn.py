"""The multi-turn agent loop of one trajectory: sample, step the environment, append, repeat.

Token-in/token-out: the sampled ids go into the trajectory unchanged (trained, `loss_mask` 1);
between turns come the template's turn-closing tokens the model did not sample and the
observations as the template renders them (`skylift.generator.chat`), untrained (`loss_mask` 0,
logprob 0). The prompt and observations are rendered with the environment's tools (``tools=``) and
``generator.chat_template_kwargs``. Each step's reward is kept at the turn's last sampled token
(`Trajectory.turn_rewards`); the trajectory's reward is their sum. With
``generator.step_wise_trajectories`` each turn is its own sample instead, its prompt the
conversation rendered afresh (`skylift.generator.step_wise`).
"""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from skylift.envs.token_env import TokenEnvironment
from skylift.generator.chat import ChatFormat
from skylift.generator.rollout_end import append_untrained, finish_rollout
from skylift.generator.settings import TURN_SEED_STRIDE, GeneratorSettings
from skylift.generator.step_wise import Step
from skylift.generator.token_turns import run_token_turns
from skylift.generator.trajectory import Trajectory
from skylift.inference.types import Completion, InferenceEngine, SamplingParams

EnvCall = Callable[..., Awaitable[Any]]
Resubmit = Callable[[list[int], Completion, SamplingParams, str | None], Awaitable[Completion]]


@dataclass
class TurnLoop:
    """What the loop needs of its generator: engine, template, settings and how to call envs."""

    engine: InferenceEngine
    chat: ChatFormat
    settings: GeneratorSettings
    call_env: EnvCall  # awaits env.init/step/close, sync or async
    resubmit: Resubmit  # continues an aborted sample

    async def run(
        self,
        row: Any,
        env: Any,
        extras: dict[str, Any],
        params: SamplingParams,
        policy_version: int,
        seed: int | None,
    ) -> list[Trajectory]:
        """The rollout's trajectory, or its steps (`generator.step_wise_trajectories`)."""
        if isinstance(env, TokenEnvironment):  # token ids in and out (tinker-cookbook's Env)
            return await run_token_turns(self, row, env, extras, params, policy_version, seed)
        s = self.settings
        tokenizer = self.chat.tokenizer
        messages = await self.call_env(env.init, row.prompt, extras)
        tools = env.tool_schemas()
        prompt_ids = self.chat.prompt_ids(messages, tools)
        conversation = [dict(m) for m in messages]  # step-wise: rendered afresh every turn
        steps: list[Step] = []
        session_id = uuid.uuid4().hex
        max_total = s.max_input_length or (s.max_prompt_length + s.max_generate_length * s.max_turns)
        response_ids: list[int] = []
        loss_mask: list[int] = []
        logprobs: list[float] = []
        texts: list[str] = []
        turn_rewards: list[tuple[int, float]] = []
        metrics: dict[str, float] = {}
        stop_reason, turns, metadata = "length", 0, {}
        versions: list[int] | None = []
        while turns < s.max_turns:
            if s.step_wise and turns > 0:
                context = self.chat.prompt_ids(conversation, tools)
            else:
                context = prompt_ids + response_ids
            budget = min(params.max_tokens, s.max_generate_length, max_total - len(context))
            if budget <= 0:
                stop_reason = "length"
                break
            turn_seed = None if seed is None else seed + turns * TURN_SEED_STRIDE
            turn_params = replace(params, max_tokens=budget, seed=turn_seed)
            out = await self.engine.generate([context], turn_params, session_id)
            completion = await self.resubmit(context, out[0].completions[0], turn_params, session_id)
            turns += 1
            sampled = list(completion.token_ids)
            if versions is not None and completion.token_versions is not None and s.engine_versions:
                versions += completion.token_versions
            else:
                versions = None
            response_ids += sampled
            loss_mask += [1] * len(sampled)
            logprobs += completion.logprobs or [0.0] * len(sampled)
            text = tokenizer.decode(sampled, skip_special_tokens=True)
            texts.append(text)
            stop_reason = completion.stop_reason
            if s.step_wise:
                turn_versions = completion.token_versions if s.engine_versions else None
                turn_logprobs = list(completion.logprobs or [0.0] * len(sampled))
                steps.append(Step(context, sampled, turn_logprobs, turn_versions, stop_reason, text))
            result = await self.call_env(env.step, text)
            turn_rewards.append((len(response_ids) - 1, float(result.reward)))
            for name, value in (result.metrics or {}).items():
                metrics[name] = metrics.get(name, 0.0) + float(value)
            metadata = dict(result.metadata)
            if result.done or not result.observations:
                break
            if s.step_wise:
                conversation += [{"role": "assistant", "content": text}, *map(dict, result.observations)]
                continue
            between = self._between_turns(sampled, completion.stop_reason, result.observations, tools)
            append_untrained(between, response_ids, loss_mask, logprobs, versions, policy_version)
        await self.call_env(env.close)
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

    def _between_turns(
        self, sampled: list[int], stop_reason: str, observations: list[dict[str, Any]], tools: Any
    ) -> list[int]:
        """Untrained tokens after a turn: the template's rest of the turn, the observations and the
        next assistant header; without `conversation_multi_turn`, the observations' plain text."""
        if not self.settings.conversation_multi_turn:
            text = "".join(str(message["content"]) for message in observations)
            return [int(t) for t in self.chat.tokenizer.encode(text, add_special_tokens=False)]
        # the model sampled the end of its turn, or stopped on a stop string / was truncated
        unfinished = self.settings.append_eos_after_stop_str if stop_reason == "stop" else True
        close = self.chat.close_turn(sampled, close_unfinished=unfinished, tools=tools)
        return close + self.chat.observation_ids(observations, tools)
