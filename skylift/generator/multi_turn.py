"""The multi-turn agent loop of one trajectory: sample, step the environment, append, repeat.

Token-in/token-out: the sampled ids go into the trajectory unchanged (trained, `loss_mask` 1),
unless the environment rewrites the turn (``postprocessed_action`` in the step's metadata):
then the conversation goes on from the rewritten text, its ids as the tokenizer encodes it; the ids
it shares from the start with what was sampled stay trained, the rest are untrained (never sampled);
between turns come the template's turn-closing tokens the model did not sample and the
observations as the template renders them, read off the rendering of the whole conversation at hand
(`skylift.generator.chat.ConversationIds`), untrained (`loss_mask` 0, logprob 0). When that
rendering does not extend the trajectory's ids (the template rewrites history), the rollout stops
with `TemplateMismatch`, or with ``generator.on_template_mismatch=step_wise`` goes on step-wise. The prompt and observations are rendered with the environment's tools (``tools=``) and
``generator.chat_template_kwargs``. Each step's reward is kept at the turn's last sampled token
(`Trajectory.turn_rewards`); the trajectory's reward is their sum. With
``generator.step_wise_trajectories`` each turn is its own sample instead, its prompt the
conversation rendered afresh (`skylift.generator.step_wise`). The rollout's wall-clock time, its
engine and environment seconds, go to its (last) trajectory's `timing` (`skylift.generator.timing`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from skylift.envs.token_env import TokenEnvironment
from skylift.generator.chat import ChatFormat, ConversationIds, TemplateMismatch
from skylift.generator.rollout_end import RolloutRecord, RolloutTask
from skylift.generator.rollout_errors import check_prompt_length
from skylift.generator.settings import GeneratorSettings
from skylift.generator.step_wise import TurnRecord
from skylift.generator.timing import Clock, TrajectoryTimer
from skylift.generator.token_turns import run_token_turns
from skylift.generator.trajectory import Trajectory
from skylift.generator.vision import VisionError, VisionInputs, generate_with_images, message_images
from skylift.inference.types import Completion, InferenceEngine, SamplingParams

EnvCall = Callable[..., Awaitable[Any]]
#: continues an aborted sample: (context, completion, params, session id, the context's images)
Resubmit = Callable[[list[int], Completion, SamplingParams, str | None, list[Any]], Awaitable[Completion]]


@dataclass
class TurnLoop:
    """What the loop needs of its generator: engine, template, settings and how to call envs."""

    engine: InferenceEngine
    chat: ChatFormat
    settings: GeneratorSettings
    call_env: EnvCall  # awaits env.init/step/close, sync or async
    resubmit: Resubmit  # continues an aborted sample
    clock: Clock = time.monotonic  # times each rollout
    vision: VisionInputs | None = None  # a vision-language model's (None: images are refused)

    async def run(self, task: RolloutTask) -> list[Trajectory]:
        """The trajectory of the rollout `task`, or its steps (`generator.step_wise_trajectories`);
        the last one carries the rollout's `timing`."""
        timer = TrajectoryTimer(self.clock)
        if isinstance(task.env, TokenEnvironment):  # token ids in and out (tinker-cookbook's Env)
            out = await run_token_turns(self, timer, task)
        else:
            out = await self._text_turns(timer, task)
        if out:
            out[-1].timing = timer.times()
        return out

    async def _text_turns(self, timer: TrajectoryTimer, task: RolloutTask) -> list[Trajectory]:
        s, row, env = self.settings, task.row, task.env
        messages = await self.call_env(env.init, row.prompt, task.extras)
        tools = env.tool_schemas()
        track = ConversationIds(self.chat, messages, tools)  # what the template renders so far
        check_prompt_length(row.uid, track.ids, s.max_prompt_length)
        rollout = RolloutRecord(list(track.ids), task.policy_version)
        rollout.images = self._images(row.uid, messages, s)
        conversation = [dict(m) for m in messages]  # step-wise: rendered afresh every turn
        turns: list[TurnRecord] = []  # for a switch to step-wise (generator.on_template_mismatch)
        while rollout.turns < s.max_turns:
            if s.step_wise and rollout.turns > 0:
                context = self.chat.prompt_ids(conversation, tools)
            else:
                context = rollout.prompt_ids + rollout.response_ids
            turn_params = rollout.turn_params(s, task.params, context, task.seed)
            if turn_params is None:
                break
            completion, text, sampled = await self.sample_turn(timer, rollout, s, context, turn_params, turns)
            result = await timer.timed("env", self.call_env(env.step, text))
            stop_reason = completion.stop_reason
            postprocessed = result.metadata.get("postprocessed_action")
            if isinstance(postprocessed, str) and postprocessed != text:  # the conversation goes on from it
                text, stop_reason = postprocessed, "postprocessed"  # its turn is closed by the template
                if not s.step_wise:  # a step trains on what it sampled; the next step's context has `text`
                    new_ids = self.chat.tokenizer.encode(text, add_special_tokens=False)
                    sampled = rollout.replace_turn(sampled, [int(t) for t in new_ids], text)
            rollout.add_answer(result.reward, result.metrics, result.metadata)
            if result.done or not result.observations:
                break
            rollout.images += self._images(row.uid, result.observations, s)
            conversation += [{"role": "assistant", "content": text}, *map(dict, result.observations)]
            if s.step_wise:
                continue
            try:
                between = self._between_turns(track, sampled, text, stop_reason, result.observations)
            except TemplateMismatch:
                if s.on_template_mismatch != "step_wise":
                    raise
                # this rollout goes on step-wise, the next prompt the conversation as the template
                # renders it now
                s = rollout.go_step_wise(s, turns)
                continue
            rollout.add_untrained(between)
        await self.call_env(env.close)
        return rollout.finish(row, s)

    async def sample_turn(
        self,
        timer: TrajectoryTimer,
        rollout: RolloutRecord,
        s: GeneratorSettings,
        context: list[int],
        params: SamplingParams,
        turns: list[TurnRecord],
    ) -> tuple[Completion, str, list[int]]:
        """Sample one turn after `context` (an aborted sample continued: `resubmit`) and record it in
        `rollout` and `turns`: (its completion, its text, the ids `rollout` holds as sampled)."""
        # every image so far, one image token each in `context`
        call = generate_with_images(self.engine, [context], params, [rollout.images], rollout.session_id)
        out = await timer.timed("llm", call)
        completion = await timer.timed(
            "llm",
            self.resubmit(context, out[0].completions[0], params, rollout.session_id, list(rollout.images)),
        )
        text = self.chat.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        sampled = rollout.add_turn(s, context, completion, text)
        turns.append((len(context), completion, text))
        return completion, text, sampled

    def _images(self, uid: str, messages: list[dict[str, Any]], s: GeneratorSettings) -> list[Any]:
        """The images of a prompt's or an observation's messages (`VisionError` where they
        cannot go: a text-only model, step-wise samples, observations as plain text)."""
        images = message_images(messages, f"prompt {uid}")
        if not images:
            return images
        if self.vision is None:
            raise VisionError(f"prompt {uid} has image(s) but the policy is not a vision-language model")
        if s.step_wise or s.on_template_mismatch == "step_wise" or not s.conversation_multi_turn:
            raise VisionError(
                f"prompt {uid}: images in multi-turn rollouts need whole trajectories with chat observations "
                "(generator.step_wise_trajectories=false, generator.on_template_mismatch=error, "
                "generator.use_conversation_multi_turn=true)"
            )
        return images

    def _between_turns(
        self,
        track: ConversationIds,
        sampled: list[int],
        text: str,
        stop_reason: str,
        observations: list[dict[str, Any]],
    ) -> list[int]:
        """Untrained tokens after a turn: the template's rest of the turn, the observations and the
        next assistant header, read off the conversation at hand (`TemplateMismatch` when the
        template renders it differently than the trajectory holds it); without
        `conversation_multi_turn`, the observations' plain text."""
        if not self.settings.conversation_multi_turn:
            text = "".join(str(message["content"]) for message in observations)
            return [int(t) for t in self.chat.tokenizer.encode(text, add_special_tokens=False)]
        # a stop string ended the turn (the model did not sample the template's end of turn)
        special = set(getattr(self.chat.tokenizer, "all_special_ids", []) or [])
        stop_string = stop_reason == "stop" and bool(sampled) and sampled[-1] not in special
        drop = stop_string and not self.settings.append_eos_after_stop_str
        return track.after_turn(sampled, text, observations, drop_close=drop)
