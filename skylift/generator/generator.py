"""Turns prompt rows into scored trajectories through any `InferenceEngine`.

Single-turn (the default): one batched `generate` call for all prompts with `n` samples each,
then one environment step per sample (with per-prompt `seeds`, one call per prompt, concurrently:
each prompt's samples then depend only on its seed, not on how prompts are batched or routed).
Multi-turn (`max_turns > 1`, or `batched=False`): an async agent loop per trajectory; environment
observations are appended as chat messages tokenised with the chat template (or, with
`conversation_multi_turn=False`, as plain text continuing the assistant's turn) and masked out of
the loss. `env_workers > 0` runs the environments' `step` calls in that many threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import uuid
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol

from skylift.envs import make_env
from skylift.generator.trajectory import Trajectory
from skylift.inference.types import Completion, InferenceEngine, SamplingParams

#: Seed offset between the turns of one multi-turn trajectory (samples of a row are 1 apart).
TURN_SEED_STRIDE = 1_000_003


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


@dataclass
class GeneratorSettings:
    max_prompt_length: int = 512
    max_generate_length: int = 256
    max_turns: int = 1
    max_input_length: int | None = None  # multi-turn context cap; None = prompt + generate length
    zero_reward_on_non_stop: bool = False
    apply_overlong_filtering: bool = False
    env_kwargs: dict[str, Any] | None = None
    default_env_class: str = "gsm8k"
    batched: bool = True  # single-turn: one request for the batch (False: the agent loop per trajectory)
    conversation_multi_turn: bool = True  # observations as chat messages (False: as plain text)
    env_workers: int = 0  # threads for env.step; 0 = call it inline
    #: a sample the engine aborted (a weight update with pause mode "abort") is resubmitted: its
    #: prompt plus the tokens sampled so far, for the tokens left (at most `MAX_RESUBMITS` times)
    resubmit_aborted: bool = False
    #: label trajectories with the engines' per-token weight versions (fully async training, where
    #: the engines are told each version); False: with the caller's `policy_version` (an engine's
    #: labels may be left from another run or client of a shared server)
    engine_versions: bool = False


#: The most times one sample is resubmitted after an abort before it is kept as aborted.
MAX_RESUBMITS = 32


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
    )


class Generator:
    """Rolls out prompts on an engine (or a router over several) and scores them."""

    def __init__(self, engine: InferenceEngine, tokenizer: Any, settings: GeneratorSettings) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.settings = settings
        self._env_pool: ThreadPoolExecutor | None = None  # during `generate` with env_workers > 0
        self._env_users = 0  # `generate` calls running

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
        if seeds is not None and len(seeds) != len(rows):
            raise ValueError(f"got {len(seeds)} seeds for {len(rows)} rows")
        workers = self.settings.env_workers
        if workers > 0 and self._env_pool is None:  # shared by concurrent calls (fully async)
            self._env_pool = ThreadPoolExecutor(workers, thread_name_prefix="env")
        self._env_users += 1
        try:
            if self.settings.max_turns > 1 or not self.settings.batched:
                params = replace(params, n=1)
                tasks = [
                    self._multi_turn(row, params, policy_version, None if seeds is None else seeds[i] + j)
                    for i, row in enumerate(rows)
                    for j in range(n)
                ]
                return list(await asyncio.gather(*tasks))
            return await self._single_turn(rows, n, replace(params, n=n), policy_version, seeds)
        finally:
            self._env_users -= 1
            if self._env_pool is not None and self._env_users == 0:
                self._env_pool.shutdown(wait=False)
                self._env_pool = None

    def encode_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        return _chat_token_ids(self.tokenizer, messages, add_generation_prompt=True)

    # ------------------------------------------------------------------ single turn
    async def _single_turn(
        self,
        rows: Sequence[PromptRow],
        n: int,
        params: SamplingParams,
        policy_version: int,
        seeds: Sequence[int] | None,
    ) -> list[Trajectory]:
        envs_per_row = []
        prompts: list[list[int]] = []
        for row in rows:
            envs = [self._make_env(row) for _ in range(n)]
            messages = [env.init(row.prompt, self._extras(row)) for env in envs][0]
            ids = self.encode_prompt(messages)
            if len(ids) > self.settings.max_prompt_length:
                raise ValueError(
                    f"prompt {row.uid} has {len(ids)} tokens, more than max_prompt_length="
                    f"{self.settings.max_prompt_length}"
                )
            prompts.append(ids)
            envs_per_row.append(envs)
        params = replace(params, max_tokens=min(params.max_tokens, self.settings.max_generate_length))
        if seeds is None:
            outputs = await self.engine.generate(prompts, params)
        else:
            answers = await asyncio.gather(
                *(
                    self.engine.generate([p], replace(params, seed=s))
                    for p, s in zip(prompts, seeds, strict=True)
                )
            )
            outputs = [answer[0] for answer in answers]
        scoring = []
        for row, envs, prompt_ids, output in zip(rows, envs_per_row, prompts, outputs, strict=True):
            if len(output.completions) != n:
                raise RuntimeError(
                    f"engine returned {len(output.completions)} samples for {row.uid}, asked {n}"
                )
            for env, completion in zip(envs, output.completions, strict=True):
                scoring.append(self._score(row, env, prompt_ids, completion, policy_version, params))
        return list(await asyncio.gather(*scoring))

    async def _resubmitted(
        self,
        prompt_ids: list[int],
        completion: Completion,
        params: SamplingParams,
        session_id: str | None = None,
    ) -> Completion:
        """`completion`, continued while the engine aborted it (see `resubmit_aborted`)."""
        for _ in range(MAX_RESUBMITS):
            left = params.max_tokens - len(completion.token_ids)
            if not self.settings.resubmit_aborted or completion.stop_reason != "abort" or left <= 0:
                break
            seed = None if params.seed is None else params.seed + len(completion.token_ids)
            again = replace(params, n=1, max_tokens=left, seed=seed)
            out = await self.engine.generate([prompt_ids + list(completion.token_ids)], again, session_id)
            completion = join_completions(completion, out[0].completions[0])
        return completion

    async def _env_step(self, env: Any, text: str) -> Any:
        if self._env_pool is None:
            return env.step(text)
        return await asyncio.get_running_loop().run_in_executor(self._env_pool, env.step, text)

    async def _score(
        self,
        row: PromptRow,
        env: Any,
        prompt_ids: list[int],
        completion: Completion,
        policy_version: int,
        params: SamplingParams,
    ) -> Trajectory:
        completion = await self._resubmitted(prompt_ids, completion, params)
        versions = completion.token_versions if self.settings.engine_versions else None
        text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        result = await self._env_step(env, text)
        env.close()
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
            env_metadata=dict(result.metadata),
            response_text=text,
        )

    # ------------------------------------------------------------------ multi turn
    async def _multi_turn(
        self, row: PromptRow, params: SamplingParams, policy_version: int, seed: int | None
    ) -> Trajectory:
        env = self._make_env(row)
        messages = env.init(row.prompt, self._extras(row))
        prompt_ids = self.encode_prompt(messages)
        session_id = uuid.uuid4().hex
        max_total = self.settings.max_input_length or (
            self.settings.max_prompt_length + self.settings.max_generate_length * self.settings.max_turns
        )
        response_ids: list[int] = []
        loss_mask: list[int] = []
        logprobs: list[float] = []
        texts: list[str] = []
        reward, stop_reason, turns, metadata = 0.0, "length", 0, {}
        versions: list[int] | None = []
        while turns < self.settings.max_turns:
            budget = min(
                params.max_tokens,
                self.settings.max_generate_length,
                max_total - len(prompt_ids) - len(response_ids),
            )
            if budget <= 0:
                stop_reason = "length"
                break
            turn_seed = None if seed is None else seed + turns * TURN_SEED_STRIDE
            turn_params = replace(params, max_tokens=budget, seed=turn_seed)
            out = await self.engine.generate([prompt_ids + response_ids], turn_params, session_id)
            completion = await self._resubmitted(
                prompt_ids + response_ids, out[0].completions[0], turn_params, session_id
            )
            turns += 1
            if (
                versions is not None
                and completion.token_versions is not None
                and self.settings.engine_versions
            ):
                versions += completion.token_versions
            else:
                versions = None
            response_ids += completion.token_ids
            loss_mask += [1] * len(completion.token_ids)
            logprobs += completion.logprobs or [0.0] * len(completion.token_ids)
            text = self.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
            texts.append(text)
            stop_reason = completion.stop_reason
            result = await self._env_step(env, text)
            reward += float(result.reward)
            metadata = dict(result.metadata)
            if result.done or not result.observations:
                break
            obs_ids = self._observation_ids(result.observations)
            response_ids += obs_ids
            loss_mask += [0] * len(obs_ids)
            logprobs += [0.0] * len(obs_ids)
            if versions is not None:
                versions += [versions[-1] if versions else policy_version] * len(obs_ids)
        env.close()
        if stop_reason != "stop" and self.settings.zero_reward_on_non_stop:
            reward = 0.0
        if stop_reason != "stop" and self.settings.apply_overlong_filtering:
            loss_mask = [0] * len(loss_mask)
        return Trajectory(
            uid=row.uid,
            prompt_ids=prompt_ids,
            response_ids=response_ids,
            loss_mask=loss_mask,
            rollout_logprobs=logprobs,
            reward=reward,
            stop_reason=stop_reason,
            data_source=row.data_source,
            num_turns=turns,
            policy_version=min(versions) if versions else policy_version,
            token_versions=versions or None,
            env_metadata=metadata,
            response_text="\n".join(texts),
        )

    def _observation_ids(self, observations: list[dict[str, str]]) -> list[int]:
        """Tokens of observation messages as they continue a conversation, plus the next
        assistant header: the chat template of (base + obs) minus that of (base). Without
        `conversation_multi_turn`: the observations' text, continuing the assistant's turn."""
        if not self.settings.conversation_multi_turn:
            text = "".join(str(message["content"]) for message in observations)
            return [int(t) for t in self.tokenizer.encode(text, add_special_tokens=False)]
        base = [{"role": "system", "content": "x"}]
        with_obs = self.encode_prompt(base + list(observations))
        without = _chat_token_ids(self.tokenizer, base, add_generation_prompt=False)
        return with_obs[len(without) :]

    # ------------------------------------------------------------------ helpers
    def _make_env(self, row: PromptRow) -> Any:
        return make_env(row.env_class or self.settings.default_env_class, **(self.settings.env_kwargs or {}))

    @staticmethod
    def _extras(row: PromptRow) -> dict[str, Any]:
        return {"reward_spec": row.reward_spec, "extra_info": row.extra_info, "data_source": row.data_source}


def _chat_token_ids(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
    """Token ids of a chat rendered with the tokenizer's template (a plain list of ints)."""
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=False
    )
    if hasattr(ids, "keys"):  # some versions return a BatchEncoding regardless
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]
