"""tinker-cookbook's token-level ``Env`` / ``EnvGroupBuilder`` as skylift environments.

Select it with ``env_class: "tinker-cookbook:package.module:factory"`` (the dataset column or
``environment.env_class``). ``factory(row, group_size, tokenizer, **kwargs)`` returns a
``tinker_cookbook.rl.types.EnvGroupBuilder`` for one dataset row: ``row`` is a dict of the row's
``prompt``, ``reward_spec``, ``extra_info`` and ``data_source``; ``group_size`` is
``generator.n_samples_per_prompt``; ``tokenizer`` the policy's (for a renderer:
``tinker_cookbook.renderers.get_renderer(name, tokenizer)``); the entries of
``environment.env_kwargs`` whose names the factory's signature declares are passed to it.

Per prompt, the builder's ``make_envs()`` makes the group's environments (one per sample, so it
must make exactly ``group_size``); each runs as a `TokenEnvironment`: ``initial_observation()`` is
the prompt (its stop condition the sampling stop), ``step(action, extra={"stop_reason": ...})``
gets the sampled ids, its reward is that turn's and its ``next_observation`` the next turn's whole
context. Once the group is done, ``compute_group_rewards`` gets tinker-cookbook ``Trajectory``
objects built from the transitions and its rewards are added to each trajectory's (its metrics are
logged as ``env/group/<name>``); then ``cleanup()``. Numeric ``metrics`` of steps are logged as
``env/<name>``. An ``InitialObservationOverflow`` (prompt over the environment's budget) is an
error, as a prompt over ``trainer.max_prompt_length`` is.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from skylift.envs.base import Environment, EnvUsageError, Message
from skylift.envs.registry import register_env_resolver
from skylift.envs.token_env import TokenEnvironment, TokenPrompt, TokenStep

PREFIX = "tinker-cookbook:"


@dataclass
class _Group:
    """What a prompt's environments share: the builder and its tinker-cookbook environments."""

    builder: Any
    envs: list[Any]


class TinkerCookbookEnv(TokenEnvironment):
    """One sample of a tinker-cookbook ``EnvGroupBuilder``'s group."""

    def __init__(self, factory: Callable[..., Any], name: str, **config: Any) -> None:
        super().__init__(**config)
        self.factory = factory
        self.name = name
        self.inner: Any = None
        self.group: _Group | None = None
        self.transitions: list[Any] = []
        self.observation: Any = None

    async def setup_group(
        self, group: list[Environment], prompt: list[Message], extras: dict[str, Any]
    ) -> None:
        row = {"prompt": [dict(m) for m in prompt], **extras}
        builder = self.factory(row=row, group_size=len(group), tokenizer=self.tokenizer, **_accepted(self))
        envs = list(await builder.make_envs())
        if len(envs) != len(group):
            raise ValueError(
                f"{self.name}: the EnvGroupBuilder made {len(envs)} environments for a group of "
                f"{len(group)} samples (generator.n_samples_per_prompt); make group_size of them"
            )
        shared = _Group(builder, envs)
        for env, inner in zip(group, envs, strict=True):
            if not isinstance(env, TinkerCookbookEnv):
                raise TypeError(f"{self.name}: a group mixes environment kinds ({type(env).__name__})")
            env.inner, env.group = inner, shared

    async def init_tokens(self, prompt: list[Message], extras: dict[str, Any]) -> TokenPrompt:
        from tinker_cookbook.rl.types import InitialObservationOverflow

        super().init(prompt, extras)
        if self.inner is None:
            raise EnvUsageError(f"{self.name}: init before setup_group (the generator calls it per prompt)")
        out = await self.inner.initial_observation()
        if isinstance(out, InitialObservationOverflow):
            raise ValueError(f"{self.name}: the prompt exceeds the environment's token budget ({out.logs})")
        self.observation, stop = out
        return TokenPrompt(ids=_ints(self.observation), stop=list(stop) if stop else None)

    async def step_tokens(
        self, action: list[int], stop_reason: str, logprobs: list[float] | None
    ) -> TokenStep:
        from tinker_cookbook.completers import TokensWithLogprobs
        from tinker_cookbook.rl.types import Transition

        self._begin_step()
        if self.inner is None:
            raise EnvUsageError(f"{self.name}: step before init")
        reason = "stop" if stop_reason == "stop" else "length"
        result = await self.inner.step(list(action), extra={"stop_reason": reason})
        done = bool(result.episode_done)
        self.transitions.append(
            Transition(
                ob=self.observation,
                ac=TokensWithLogprobs(tokens=list(action), maybe_logprobs=logprobs, stop_reason=reason),
                reward=float(result.reward),
                episode_done=done,
                metrics=dict(result.metrics),
                logs=dict(result.logs),
            )
        )
        self.observation = result.next_observation
        self.done = done
        stop = result.next_stop_condition
        return TokenStep(
            reward=float(result.reward),
            done=done,
            next_ids=[] if done else _ints(result.next_observation),
            stop=list(stop) if stop else None,
            metadata={"logs": dict(result.logs)} if result.logs else {},
            metrics=_numbers(result.metrics),
        )

    async def finish_group(
        self, group: list[Environment], trajectories: list[Any]
    ) -> list[tuple[float, dict[str, float]]]:
        from tinker_cookbook.rl.types import Trajectory

        if self.group is None:
            raise EnvUsageError(f"{self.name}: finish_group before setup_group")
        try:
            cookbook = [
                Trajectory(transitions=list(env.transitions), final_ob=env.observation)
                for env in group
                if isinstance(env, TinkerCookbookEnv)
            ]
            pairs = await self.group.builder.compute_group_rewards(cookbook, self.group.envs)
        finally:
            await self.group.builder.cleanup()
        if len(pairs) != len(group):
            raise ValueError(
                f"{self.name}: compute_group_rewards returned {len(pairs)} rewards for {len(group)}"
            )
        return [(float(reward), _numbers(metrics)) for reward, metrics in pairs]


def _ints(observation: Any) -> list[int]:
    try:
        return [int(t) for t in observation.to_ints()]
    except ValueError as exc:  # image chunks
        raise ValueError(f"tinker-cookbook observation is not text-only: {exc}") from exc


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {str(k): float(v) for k, v in (metrics or {}).items() if isinstance(v, int | float)}


def _accepted(env: TinkerCookbookEnv) -> dict[str, Any]:
    """The env_kwargs entries that the factory's signature names (all with a ``**kwargs``)."""
    params = inspect.signature(env.factory).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return dict(env.config)
    names = {p.name for p in params}
    return {k: v for k, v in env.config.items() if k in names}


def cookbook_factory(name: str) -> Callable[..., Environment]:
    """A factory for ``make_env(name, **config)`` from ``tinker-cookbook:package.module:factory``."""
    target = name[len(PREFIX) :]
    module_name, _, attr = target.partition(":")
    if not module_name or not attr:
        raise ValueError(f"environment {name!r}: write it as {PREFIX}package.module:factory")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"environment {name!r}: cannot import {attr} from {module_name}: {exc}") from exc
    if not callable(factory):
        raise TypeError(f"environment {name!r}: {attr} is not callable")
    return lambda **config: TinkerCookbookEnv(factory, name, **config)


@register_env_resolver
def resolve(name: str) -> Callable[..., Environment] | None:
    """The env registry's resolver: ``tinker-cookbook:...`` names, else None."""
    return cookbook_factory(name) if name.startswith(PREFIX) else None
