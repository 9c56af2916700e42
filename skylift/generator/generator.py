"""Turns prompt rows into scored trajectories through any `InferenceEngine`.

Single-turn (the default): one batched `generate` call for all prompts with `n` samples each,
then one environment step per sample (with per-prompt `seeds`, one call per prompt, concurrently:
each prompt's samples then depend only on its seed, not on how prompts are batched or routed).
Multi-turn (`max_turns > 1`, `batched=False`, or a token-level environment): an async agent loop
per trajectory (`skylift.generator.multi_turn`, `skylift.generator.token_turns`), token-in/token-out
with the chat template's turn boundaries. A prompt's `n` environments are made together and their
group hooks (``setup_group``/``finish_group``) run around their trajectories.
Environments may be sync or ``async``: plain ``init``/``step``/``close`` run in `env_workers`
threads (inline when 0), coroutines are awaited. Each environment gets ``llm`` (the policy's
engines, or an OpenAI-compatible URL) and a shared ``tool_runner`` before ``init``.
Each rollout's wall-clock time and its engine and environment seconds go to its trajectory's
`timing` (`skylift.generator.timing`: completion, engine and environment seconds).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Protocol

from skylift.envs import Environment, make_env
from skylift.envs.llm import OpenAIChatClient
from skylift.envs.token_env import TokenEnvironment
from skylift.envs.tools import ToolRunner
from skylift.generator.chat import ChatFormat
from skylift.generator.llm import EngineChatClient
from skylift.generator.multi_turn import TurnLoop
from skylift.generator.rollout_end import RolloutTask
from skylift.generator.rollout_errors import (
    EnvironmentFailed,
    check_prompt_length,
    checked_step,
    env_raised,
    number,
    rollout_of,
)
from skylift.generator.routed import routed_tokens
from skylift.generator.settings import MAX_RESUBMITS, TURN_SEED_STRIDE, GeneratorSettings
from skylift.generator.timing import Clock, TrajectoryTimer
from skylift.generator.trajectory import Trajectory
from skylift.generator.vision import VisionError, VisionInputs, generate_with_images, message_images
from skylift.inference.types import Completion, InferenceEngine, SamplingParams

__all__ = [
    "MAX_RESUBMITS",
    "TURN_SEED_STRIDE",
    "Generator",
    "GeneratorSettings",
    "join_completions",
    "rollout_seed",
]


def rollout_seed(base: int, step: int, prompt_uid: str) -> int:
    """The sampling seed of prompt `prompt_uid` at training step `step` (-1: evaluation) in a run
    seeded with `base`: a 32-bit hash, so prompts and steps get unrelated streams."""
    digest = hashlib.blake2b(f"{base}:{step}:{prompt_uid}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little")


class PromptRow(Protocol):
    """What the generator needs of a dataset row (see `skylift.data.PromptSample`)."""

    prompt: list[dict[str, str]]
    env_class: str
    reward_spec: dict[str, Any]
    extra_info: dict[str, Any]
    data_source: str
    uid: str


def join_completions(first: Completion, rest: Completion) -> Completion:
    """A sample continued after an abort: `first`'s tokens then `rest`'s (versions and logprobs
    kept when both have them), `rest`'s stop reason."""
    logprobs = None if first.logprobs is None or rest.logprobs is None else first.logprobs + rest.logprobs
    versions = (
        None
        if first.token_versions is None or rest.token_versions is None
        else first.token_versions + rest.token_versions
    )
    return Completion(
        token_ids=list(first.token_ids) + list(rest.token_ids),
        logprobs=logprobs,
        stop_reason=rest.stop_reason,
        text=None,
        matched_stop=rest.matched_stop,
        token_versions=versions,
        # the continuation's request held the first part: its routing covers it too
        routed_experts=first.routed_experts if rest.routed_experts is None else rest.routed_experts,
    )


def seed_of_each_row(rows: Sequence[Any], seeds: Sequence[int] | None) -> list[int | None]:
    """The seed of each of `rows` (None for each without `seeds`); `seeds` must hold one per row."""
    if seeds is None:
        return [None] * len(rows)
    if len(seeds) != len(rows):
        raise ValueError(f"got {len(seeds)} seeds for {len(rows)} rows")
    return list(seeds)


class Generator:
    """Rolls out prompts on an engine (or a router over several) and scores them."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any,
        settings: GeneratorSettings,
        clock: Clock = time.monotonic,
        vision: VisionInputs | None = None,
    ) -> None:
        self.engine = engine
        self.vision = vision  # a vision-language model's image processing (None: text only)
        self.clock = clock  # times the rollouts
        self.tokenizer = tokenizer
        self.settings = settings
        self.chat = ChatFormat(tokenizer, settings.chat_template_kwargs)
        self._env_pool: ThreadPoolExecutor | None = None  # during `generate` with env_workers > 0
        self._env_users = 0  # `generate` calls running
        self.tool_runner = ToolRunner(settings.tool_timeout_s, settings.max_concurrent_tool_calls)
        self.llm: OpenAIChatClient | EngineChatClient = (
            EngineChatClient(engine, self.chat, settings.max_prompt_length + settings.max_generate_length)
            if settings.llm_base_url is None
            else OpenAIChatClient(settings.llm_base_url, settings.llm_model, timeout_s=settings.llm_timeout_s)
        )
        self._turns = TurnLoop(engine, self.chat, settings, self._call_env, self._resubmitted, clock, vision)

    # ------------------------------------------------------------------ public
    async def generate(
        self,
        rows: Sequence[PromptRow],
        n: int,
        params: SamplingParams,
        policy_version: int = 0,
        seeds: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        """`n` trajectories per row, grouped by row in order (row 0's n first).

        `seeds`: one per row (e.g. `rollout_seed`); sample j of a row uses seed + j (vLLM's own rule
        for n > 1), turn t of a multi-turn trajectory adds t * `TURN_SEED_STRIDE`.
        """
        row_seeds = seed_of_each_row(rows, seeds)
        workers = self.settings.env_workers
        if workers > 0 and self._env_pool is None:  # shared by concurrent calls (fully async)
            self._env_pool = ThreadPoolExecutor(workers, thread_name_prefix="env")
        self._env_users += 1
        if self.vision is not None:  # the model's own logits stay untouched (see generator.vision)
            params = replace(params, logit_bias={**(params.logit_bias or {}), **self.vision.logit_bias()})
        try:
            groups = [self._envs_of(row, n) for row in rows]
            token_level = any(isinstance(envs[0], TokenEnvironment) for envs in groups if envs)
            if self.settings.max_turns > 1 or not self.settings.batched or token_level:
                one = replace(params, n=1)
                runs = [
                    self._turn_group(row, envs, one, policy_version, row_seeds[i])
                    for i, (row, envs) in enumerate(zip(rows, groups, strict=True))
                ]
                out = [tr for group in await asyncio.gather(*runs) for tr in group]
            else:
                out = await self._single_turn(rows, groups, replace(params, n=n), policy_version, seeds)
            names = {row.uid: row.env_class or self.settings.default_env_class for row in rows}
            for tr in out:
                tr.env_class = names.get(tr.uid, "")
                if tr.images and self.vision is not None:  # a multi-turn rollout's images
                    self.vision.attach(tr, tr.images)
            return out
        finally:
            if self.vision is not None:
                self.vision.forget()
            self._env_users -= 1
            if self._env_users == 0:
                if self._env_pool is not None:
                    self._env_pool.shutdown(wait=False)
                    self._env_pool = None
                await self.llm.close()  # its HTTP session belongs to this event loop

    def encode_prompt(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        return self.chat.prompt_ids(messages, tools)

    def prompt_images(self, uid: str, messages: list[dict[str, Any]]) -> list[Any]:
        """The images of a prompt's messages; `VisionError` when the model takes none."""
        images = message_images(messages, f"prompt {uid}")
        if images and self.vision is None:
            raise VisionError(
                f"prompt {uid} has {len(images)} image(s) but the policy is not a vision-language model"
            )
        return images

    # ------------------------------------------------------------------ single turn
    async def _single_turn(
        self,
        rows: Sequence[PromptRow],
        groups: list[list[Any]],
        params: SamplingParams,
        policy_version: int,
        seeds: Sequence[int] | None,
    ) -> list[Trajectory]:
        n = params.n
        start = self.clock()  # every rollout of the batch starts here
        envs_per_row = []
        prompts: list[list[int]] = []
        images: list[list[Any]] = []
        for row, envs in zip(rows, groups, strict=True):
            with rollout_of(row.uid):
                await self._setup_group(row, envs)
                inits = await asyncio.gather(
                    *(self._call_env(env.init, row.prompt, self._extras(row)) for env in envs)
                )
                ids = self.encode_prompt(inits[0], envs[0].tool_schemas())
                check_prompt_length(row.uid, ids, self.settings.max_prompt_length)
                prompts.append(ids)
                images.append(self.prompt_images(row.uid, inits[0]))
            envs_per_row.append(envs)
        params = replace(params, max_tokens=min(params.max_tokens, self.settings.max_generate_length))
        with_images = any(images)
        if seeds is None:
            timer = TrajectoryTimer(self.clock, start)
            call = generate_with_images(self.engine, prompts, params, images)
            batch = rows[0].uid if len(rows) == 1 else f"{rows[0].uid} or another of its batch of {len(rows)}"
            with rollout_of(batch):  # one request for the batch: the engine's error may name the index
                outputs = await timer.timed("llm", call)
            llm_s = [timer.split["llm"]] * len(prompts)  # one call for the batch
        else:
            timers = [TrajectoryTimer(self.clock, start) for _ in prompts]
            answers = await asyncio.gather(
                *(
                    self._named(
                        row.uid,
                        timer.timed(
                            "llm", generate_with_images(self.engine, [p], replace(params, seed=s), [imgs])
                        ),
                    )
                    for row, p, s, imgs, timer in zip(rows, prompts, seeds, images, timers, strict=True)
                )
            )
            outputs = [answer[0] for answer in answers]
            llm_s = [timer.split["llm"] for timer in timers]
        scoring = []
        for i, (row, envs, prompt_ids, output) in enumerate(
            zip(rows, envs_per_row, prompts, outputs, strict=True)
        ):
            if len(output.completions) != n:
                raise RuntimeError(
                    f"engine returned {len(output.completions)} samples for {row.uid}, asked {n}"
                )
            for env, completion in zip(envs, output.completions, strict=True):
                timer = TrajectoryTimer(self.clock, start)
                timer.add("llm", llm_s[i])
                scoring.append(
                    self._score(row, env, prompt_ids, completion, policy_version, params, timer, images[i])
                )
        scored = [[tr] for tr in await asyncio.gather(*scoring)]
        if with_images:
            assert self.vision is not None
            for i, output in enumerate(outputs):  # the engine's expansion of the prompt, checked
                for (tr,) in scored[i * n : (i + 1) * n]:
                    self.vision.attach(tr, images[i], output.prompt_token_ids)
        finished = await asyncio.gather(
            *(
                self._named(rows[i].uid, self._finish_group(envs, scored[i * n : (i + 1) * n]))
                for i, envs in enumerate(envs_per_row)
            )
        )
        return [tr for group in finished for tr in group]

    # ------------------------------------------------------------------ groups
    async def _turn_group(
        self, row: PromptRow, envs: list[Any], params: SamplingParams, policy_version: int, seed: int | None
    ) -> list[Trajectory]:
        """The agent loop for each of a prompt's environments, between the group's hooks."""
        with rollout_of(row.uid):
            await self._setup_group(row, envs)
            runs = [
                self._turns.run(
                    RolloutTask(
                        row,
                        env,
                        self._extras(row),
                        params,
                        policy_version,
                        None if seed is None else seed + j,
                    )
                )
                for j, env in enumerate(envs)
            ]
            return await self._finish_group(envs, list(await asyncio.gather(*runs)))

    async def _setup_group(self, row: PromptRow, envs: list[Any]) -> None:
        if envs and type(envs[0]).setup_group is not Environment.setup_group:
            await self._call_env(envs[0].setup_group, envs, row.prompt, self._extras(row))

    async def _finish_group(self, envs: list[Any], rollouts: list[list[Trajectory]]) -> list[Trajectory]:
        """The trajectories of `rollouts` (one list per env: the rollout, or its steps) with the group
        rewards (and metrics) of the first env's `finish_group`, which sees each rollout's last one."""
        flat = [tr for rollout in rollouts for tr in rollout]
        if not envs or type(envs[0]).finish_group is Environment.finish_group:
            return flat
        extra = await self._call_env(envs[0].finish_group, envs, [rollout[-1] for rollout in rollouts])
        if extra is None:
            return flat
        where = f"{type(envs[0]).__name__}.finish_group"
        if not hasattr(extra, "__len__") or len(extra) != len(rollouts):
            got = f"{len(extra)} rewards" if hasattr(extra, "__len__") else type(extra).__name__
            raise EnvironmentFailed(f"{where} returned {got} for {len(rollouts)} trajectories")
        for rollout, item in zip(rollouts, extra, strict=True):
            reward, metrics = item if isinstance(item, tuple) else (item, {})
            reward = number(reward, f"{where} returned the reward")
            for tr in rollout:  # the steps of a step-wise rollout all carry its reward
                tr.reward += reward
                if tr.turn_rewards:
                    index, last = tr.turn_rewards[-1]
                    tr.turn_rewards[-1] = (index, last + reward)
            rollout[-1].metrics.update({f"group/{k}": float(v) for k, v in (metrics or {}).items()})
        return flat

    async def _resubmitted(
        self,
        prompt_ids: list[int],
        completion: Completion,
        params: SamplingParams,
        session_id: str | None = None,
        images: Sequence[Any] = (),
    ) -> Completion:
        """`completion`, continued while the engine aborted it (see `resubmit_aborted`); `images`:
        those of `prompt_ids`' image tokens, sent again with it."""
        for _ in range(MAX_RESUBMITS):
            left = params.max_tokens - len(completion.token_ids)
            if not self.settings.resubmit_aborted or completion.stop_reason != "abort" or left <= 0:
                break
            seed = None if params.seed is None else params.seed + len(completion.token_ids)
            again = replace(params, n=1, max_tokens=left, seed=seed)
            context = [prompt_ids + list(completion.token_ids)]
            out = await generate_with_images(self.engine, context, again, [images], session_id)
            completion = join_completions(completion, out[0].completions[0])
        return completion

    async def _call_env(self, method: Callable[..., Any], *args: Any) -> Any:
        """An environment's `init`/`step`/`close`: awaited when async, else in the env thread pool
        (inline without one). What it raises is marked with its class and method (`env_raised`); a
        step result without a numeric reward is an `EnvironmentFailed` saying so."""
        name = getattr(method, "__name__", "method")
        env = getattr(method, "__self__", None)
        try:
            if inspect.iscoroutinefunction(method):
                result = await method(*args)
            elif self._env_pool is None:
                result = method(*args)
            else:
                result = await asyncio.get_running_loop().run_in_executor(self._env_pool, method, *args)
            if inspect.isawaitable(result):  # a plain method that returned a coroutine
                result = await result
        except Exception as exc:
            env_raised(exc, f"{type(env).__name__}.{name}")
            raise
        return checked_step(env, name, result) if name in ("step", "step_tokens") else result

    @staticmethod
    async def _named(uid: str, awaitable: Any) -> Any:
        """`awaitable`'s result; its failures on the user's input named as prompt `uid`'s."""
        with rollout_of(uid):
            return await awaitable

    async def _score(
        self,
        row: PromptRow,
        env: Any,
        prompt_ids: list[int],
        completion: Completion,
        policy_version: int,
        params: SamplingParams,
        timer: TrajectoryTimer,
        images: Sequence[Any] = (),
    ) -> Trajectory:
        with rollout_of(row.uid):
            completion = await timer.timed(
                "llm", self._resubmitted(prompt_ids, completion, params, None, images)
            )
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            result = await timer.timed("env", self._call_env(env.step, text))
            await self._call_env(env.close)
        versions = completion.token_versions if self.settings.engine_versions else None
        reward = float(result.reward)
        loss_mask = [1] * len(completion.token_ids)
        if completion.stop_reason != "stop":
            if self.settings.zero_reward_on_non_stop:
                reward = 0.0
            if self.settings.apply_overlong_filtering:
                loss_mask = [0] * len(loss_mask)
        logprobs = completion.logprobs or [0.0] * len(completion.token_ids)
        return Trajectory(
            uid=row.uid,
            prompt_ids=prompt_ids,
            response_ids=list(completion.token_ids),
            loss_mask=loss_mask,
            rollout_logprobs=list(logprobs),
            reward=reward,
            stop_reason=completion.stop_reason,
            data_source=row.data_source,
            policy_version=min(versions) if versions else policy_version,
            token_versions=versions,
            routed_experts=routed_tokens(
                completion, len(prompt_ids) + len(completion.token_ids), self.settings.routed_experts
            ),
            env_metadata=dict(result.metadata),
            response_text=text,
            metrics={name: float(value) for name, value in (result.metrics or {}).items()},
            timing=timer.times(),
        )

    # ------------------------------------------------------------------ helpers
    def _envs_of(self, row: PromptRow, n: int) -> list[Any]:
        """The `n` environments of `row`'s samples (a failure marked as the row's: `rollout_of`)."""
        with rollout_of(row.uid):
            return [self._make_env(row) for _ in range(n)]

    def _make_env(self, row: PromptRow) -> Any:
        name = row.env_class or self.settings.default_env_class
        try:
            env = make_env(name, **(self.settings.env_kwargs or {}))
        except Exception as exc:
            env_raised(exc, f"make_env({name!r})")
            raise
        env.llm = self.llm
        env.tool_runner = self.tool_runner
        env.tokenizer = self.tokenizer
        return env

    @staticmethod
    def _extras(row: PromptRow) -> dict[str, Any]:
        """The row's other dataset columns (`PromptSample.columns`), then its
        ``reward_spec``, ``extra_info`` and ``data_source``."""
        return {
            **(getattr(row, "columns", None) or {}),
            "reward_spec": row.reward_spec,
            "extra_info": row.extra_info,
            "data_source": row.data_source,
        }
