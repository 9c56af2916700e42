"""Rollouts played by a verifiers env server (verifiers 0.4, v1 API) on the run's own engines.

`VerifiersRollouts` is the run's generator when ``environment.verifiers.address`` is set: rows
whose environment is ``verifiers`` go to the env server, one ``run`` request per sample, with the
run's remote engines (``skylift serve --enable-scale-out``, so that vLLM's
``/inference/v1/generate`` answers) as the endpoint the server samples from, round-robin; the
other rows go to skylift's own `Generator`. The engines are weight-synced by the trainer as with
any remote engine, so the episodes sample the current policy. Each episode becomes trajectories
with the exact sampled token ids and logprobs (`skylift.integrations.verifiers.episodes`).

A row's task is ``extra_info[task_key]`` (the taskset's ``TaskData`` fields as a mapping), or
``{"prompt": row.prompt}`` when the row has none.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from skylift.generator.generator import PromptRow, seed_of_each_row
from skylift.generator.plugins import RolloutContext, register_rollout_plugin
from skylift.generator.rollout_errors import rollout_of
from skylift.generator.trajectory import Trajectory
from skylift.inference.remote import normalize_url
from skylift.inference.types import SamplingParams
from skylift.integrations.verifiers.episodes import EpisodeFailed, episode_trajectories
from skylift.integrations.verifiers.wire import EnvServerRefused, MalformedEpisode, VerifiersEnvClient
from skylift.utils.calls import call_with_timeout

#: the environment name that sends a row to the env server
ENV_CLASS = "verifiers"


class TaskError(ValueError):
    """A row's verifiers task (``extra_info[task_key]``) is not a mapping."""


#: the failures of a verifiers row that are the user's side (its task, its environment on the env
#: server, the episodes it sent back); an unreachable or silent env server is not among them
USER_SIDE: tuple[type[BaseException], ...] = (TaskError, EpisodeFailed, EnvServerRefused, MalformedEpisode)


@dataclass
class VerifiersSettings:
    """``environment.verifiers.*`` (see docs/agentic.md, "verifiers")."""

    address: str
    model: str | None = None
    renderer_model: str | None = None
    client: dict[str, Any] = field(default_factory=dict)
    sampling: dict[str, Any] = field(default_factory=dict)
    task_key: str = "verifiers_task"
    health_timeout_s: float = 30.0
    run_timeout_s: float = 900.0

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> VerifiersSettings | None:
        """The settings of ``environment.verifiers`` (None when it is empty); unknown keys, a
        missing address and non-positive timeouts are refused."""
        if not options:
            return None
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"environment.verifiers: unknown key(s) {unknown}; known: {sorted(known)}")
        if not options.get("address"):
            raise ValueError(
                "environment.verifiers.address: set it to the env server's address (tcp://127.0.0.1:5000)"
            )
        settings = cls(**options)
        for name in ("client", "sampling"):
            if not isinstance(getattr(settings, name), dict):
                raise ValueError(f"environment.verifiers.{name} must be a mapping")
        for name in ("health_timeout_s", "run_timeout_s"):
            if not float(getattr(settings, name)) > 0:
                raise ValueError(f"environment.verifiers.{name} must be > 0")
        return settings


@dataclass
class EpisodeLimits:
    """What the run's generator settings say about a trajectory (as for skylift's own rollouts)."""

    max_prompt_length: int
    max_generate_length: int
    zero_reward_on_non_stop: bool = False
    apply_overlong_filtering: bool = False


def sampling_of(
    params: SamplingParams, limits: EpisodeLimits, extra: dict[str, Any], seed: int | None
) -> dict[str, Any]:
    """verifiers' SamplingConfig for `params` (its keys beyond temperature, top_p and max_tokens
    reach vLLM's sampling params as they are), then `extra` on top."""
    out: dict[str, Any] = {
        "temperature": params.temperature,
        "top_p": params.top_p,
        "max_tokens": min(params.max_tokens, limits.max_generate_length),
    }
    if params.top_k not in (-1, 0):
        out["top_k"] = params.top_k
    if params.min_p:
        out["min_p"] = params.min_p
    if params.repetition_penalty != 1.0:
        out["repetition_penalty"] = params.repetition_penalty
    if params.stop:
        out["stop"] = list(params.stop)
    if seed is not None:
        out["seed"] = seed
    return {**out, **extra}


class VerifiersRollouts:
    """The run's generator: ``verifiers`` rows through the env server, the rest through `inner`."""

    def __init__(
        self,
        inner: Any,
        engine_urls: Sequence[str],
        settings: VerifiersSettings,
        limits: EpisodeLimits,
        *,
        default_env_class: str,
        renderer_model: str,
        api_key: str | None = None,
        client: VerifiersEnvClient | None = None,
    ) -> None:
        if not engine_urls:
            raise ValueError(
                "environment.verifiers: the env server samples through the engines' HTTP API: run them "
                "as `skylift serve --enable-scale-out` servers and set generator.run_engines_locally=false "
                "and generator.remote_inference_engine_urls"
            )
        self.inner = inner
        self.urls = [normalize_url(url) for url in engine_urls]
        self.settings, self.limits = settings, limits
        self.default_env_class = default_env_class
        self.renderer_model = settings.renderer_model or renderer_model
        self.api_key = api_key
        self.client = client or VerifiersEnvClient(
            settings.address, health_timeout_s=settings.health_timeout_s, run_timeout_s=settings.run_timeout_s
        )
        self._model: str | None = settings.model
        self._next = 0

    def is_verifiers(self, row: PromptRow) -> bool:
        return (row.env_class or self.default_env_class) == ENV_CLASS

    async def generate(
        self,
        rows: Sequence[PromptRow],
        n: int,
        params: SamplingParams,
        policy_version: int = 0,
        seeds: Sequence[int] | None = None,
    ) -> list[Trajectory]:
        """`n` trajectories (or more: an episode may hold several trainable contexts) per row,
        grouped by row in order, as `Generator.generate`."""
        row_seeds = seed_of_each_row(rows, seeds)
        mine = [i for i, row in enumerate(rows) if self.is_verifiers(row)]
        others = sorted(set(range(len(rows))) - set(mine))
        if others and self.inner is None:
            raise ValueError(f"row {rows[others[0]].uid}: only verifiers rows can be generated here")
        jobs = [self._row(rows[i], n, params, policy_version, row_seeds[i]) for i in mine]
        if others:
            jobs.append(
                self.inner.generate(
                    [rows[i] for i in others],
                    n,
                    params,
                    policy_version,
                    None if seeds is None else [seeds[i] for i in others],
                )
            )
        results = await asyncio.gather(*jobs)
        by_row: dict[int, list[Trajectory]] = dict(zip(mine, results[: len(mine)], strict=True))
        if others:  # the inner generator's trajectories, back to their rows by prompt uid
            by_uid: dict[str, list[Trajectory]] = {}
            for tr in results[-1]:
                by_uid.setdefault(tr.uid, []).append(tr)
            for i in others:
                by_row[i] = by_uid.pop(rows[i].uid, [])
        return [tr for i in range(len(rows)) for tr in by_row[i]]

    async def _row(
        self, row: PromptRow, n: int, params: SamplingParams, policy_version: int, seed: int | None
    ) -> list[Trajectory]:
        """The trajectories of `row`'s `n` episodes; a failure on the user's side (`USER_SIDE`, a
        prompt past the limit) is marked as the row's (`rollout_of`), which stops training on one
        line; an env server that cannot be reached or times out is not."""
        with rollout_of(row.uid, also=USER_SIDE):
            return await self._episodes(row, n, params, policy_version, seed)

    async def _episodes(
        self, row: PromptRow, n: int, params: SamplingParams, policy_version: int, seed: int | None
    ) -> list[Trajectory]:
        task = (row.extra_info or {}).get(self.settings.task_key)
        if task is None:
            task = {"prompt": list(row.prompt)}
        if not isinstance(task, dict):
            raise TaskError(
                f"prompt {row.uid}: extra_info[{self.settings.task_key!r}] must be a mapping of the "
                f"taskset's task fields, got {type(task).__name__}"
            )
        model = await self.model()
        runs = []
        for j in range(n):
            url = self.urls[self._next % len(self.urls)]
            self._next += 1
            client = {
                "type": "train",
                "base_url": url + "/v1",
                "api_key_var": "SKYLIFT_API_KEY",
                "renderer_model_name": self.renderer_model,
                **self.settings.client,
            }
            sampling = sampling_of(
                params, self.limits, self.settings.sampling, None if seed is None else seed + j
            )
            runs.append(self.client.run(task, client, model, sampling))
        episodes = await asyncio.gather(*runs)
        return [
            tr
            for episode in episodes
            for tr in episode_trajectories(
                episode,
                row.uid,
                data_source=row.data_source,
                policy_version=policy_version,
                max_prompt_length=self.limits.max_prompt_length,
                zero_reward_on_non_stop=self.limits.zero_reward_on_non_stop,
                apply_overlong_filtering=self.limits.apply_overlong_filtering,
            )
        ]

    async def model(self) -> str:
        """The model name the env server asks the engines for: ``environment.verifiers.model``, else
        the first engine's served name (its ``/v1/models``)."""
        if self._model is None:
            self._model = await call_with_timeout(
                self.urls[0], "GET /v1/models", self._served_name(self.urls[0]), 30.0, error=RuntimeError
            )
        return self._model

    async def _served_name(self, url: str) -> str:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with (
            aiohttp.ClientSession() as session,
            session.get(url + "/v1/models", headers=headers) as resp,
        ):
            body = await resp.json(content_type=None)
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}: {body}")
        try:
            return str(body["data"][0]["id"])
        except (KeyError, IndexError, TypeError) as exc:
            raise RuntimeError(f"no served model in {body!r}") from exc

    async def aclose(self) -> None:
        await self.client.close()


class _VerifiersPlugin:
    """``environment.verifiers`` as a rollout plugin of `skylift.generator.plugins`."""

    def check(self, options: dict[str, Any]) -> VerifiersSettings | None:
        return VerifiersSettings.from_options(options)

    def wrap(self, generator: Any, settings: VerifiersSettings, context: RolloutContext) -> VerifiersRollouts:
        s = generator.settings
        return VerifiersRollouts(
            generator,
            context.engine_urls,
            settings,
            EpisodeLimits(
                s.max_prompt_length,
                s.max_generate_length,
                s.zero_reward_on_non_stop,
                s.apply_overlong_filtering,
            ),
            default_env_class=context.default_env_class,
            renderer_model=context.renderer_model,
            api_key=context.api_key,
        )


register_rollout_plugin("verifiers", _VerifiersPlugin())
