"""SkyRL-Gym environments (``skyrl_gym.envs.base_text_env.BaseTextEnv`` subclasses) in skylift.

An ``env_class`` (the dataset column or ``environment.env_class``) that skylift's own registry does
not hold is looked up here (``skylift.envs.registry.get_env_factory`` asks `skyrl_gym_factory`, the
resolver this module registers; the registry imports this module by name):

- ``package.module:Class``: the module is imported (which also runs its ``skyrl_gym.register``
  calls, so rows naming those ids resolve too) and ``Class`` is used: a skylift `Environment` as
  is, a SkyRL-Gym ``BaseTextEnv`` through `SkyRLGymEnv`;
- an id in SkyRL-Gym's registry (its built-ins ``gsm8k_multi_turn``, ``aime``, ``text2sql``, ``lcb``,
  ``search``, ``searchcode``, and every id registered by a module imported before, e.g. one listed in
  ``environment.import_modules``). A name skylift
  registers itself (``gsm8k``) selects skylift's environment; SkyRL-Gym's is
  ``skyrl_gym.envs.gsm8k.env:GSM8kEnv``.

`SkyRLGymEnv` builds the SkyRL environment as SkyRL does, ``Env(env_config=..., extras=...)``, once
per trajectory when the generator calls ``init``: ``env_config`` is SkyRL's defaults for the id
(``text2sql``'s ``db_path``; ``search``'s ``search_url``, ``topk``, ``timeout``, ``log_requests``:
skyrl-gym's own config dataclasses, which SkyRL's schema embeds) updated with
``environment.env_configs.<registered id>`` (SkyRL's ``environment.skyrl_gym.<id>``) and
``environment.env_kwargs`` (an OmegaConf mapping, as SkyRL passes it); ``extras`` is the row's other columns (e.g. text2sql's ``db_id`` and ``data``),
``reward_spec``, ``extra_info`` and ``data_source`` plus ``max_turns`` (``generator.max_turns``), as
SkyRL's generator builds them. ``step``'s dict output becomes a `StepResult`: ``observations``,
``reward``, ``done`` and ``metadata`` as they are; ``postprocessed_action`` goes into the metadata,
where the generator takes it as the turn's text from then on (`skylift.generator.multi_turn`: only
the ids it shares with the sampled ones are trained; a warning says so once per process);
``get_metrics()`` after each step is in ``metadata["env_metrics"]`` (the trajectory keeps the last
step's), and `aggregate_env_metrics` combines a batch's with the class's ``aggregate_metrics``
(the factories' ``aggregate_metrics``, which `skylift.envs.registry.aggregate_episode_metrics`
calls; logged per environment by `skylift.generator.metrics.rollout_metrics`).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from skylift.config.inputs import EnvironmentConfig
from skylift.envs.base import Environment, EnvUsageError, Message, StepResult
from skylift.envs.registry import numeric_means, numeric_only, register_env_resolver, register_run_configurer

logger = logging.getLogger("skylift.envs")

_WARNED: set[str] = set()


def _warn_postprocessed_once(env_name: str) -> None:
    """SkyRL's warning, once per environment class: a rewritten action breaks token-in/token-out."""
    if env_name not in _WARNED:
        _WARNED.add(env_name)
        logger.warning(
            "%s.step() returned a postprocessed_action: the conversation goes on from that text, "
            "re-tokenized; only the tokens it shares with what the policy sampled are trained",
            env_name,
        )


#: Set by the trainer (`configure`): ``environment.env_configs`` and ``generator.max_turns``.
_RUN: dict[str, Any] = {"configs": {}, "max_turns": 1}

#: SkyRL's schema defaults of ``environment.env_configs.<id>``: skyrl-gym's config dataclasses.
DEFAULT_CONFIGS = {
    "text2sql": "skyrl_gym.envs.sql.env:Text2SQLEnvConfig",
    "search": "skyrl_gym.envs.search.env:SearchEnvConfig",
}


def _defaults(env_id: str | None) -> dict[str, Any]:
    """SkyRL's default ``env_config`` of a built-in id (empty for others)."""
    target = DEFAULT_CONFIGS.get(env_id or "")
    if target is None:
        return {}
    import dataclasses

    module_name, _, name = target.partition(":")
    return dataclasses.asdict(getattr(importlib.import_module(module_name), name)())


@register_run_configurer
def configure_from(environment: EnvironmentConfig, max_turns: int) -> None:
    """The registry's run configurer: ``environment.env_configs`` and ``generator.max_turns``
    (``environment.import_modules`` are already imported by `skylift.envs.registry.configure_run`)."""
    configure(environment.env_configs or {}, max_turns)


def configure(configs: Mapping[str, Any], max_turns: int, import_modules: Sequence[str] = ()) -> None:
    """The run's per-environment configs (``environment.env_configs``) and turn limit; imports
    ``environment.import_modules`` (their ``register_env`` / ``skyrl_gym.register`` calls)."""
    for module in import_modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"environment.import_modules: cannot import {module!r}: {exc}") from exc
    _RUN["configs"] = {str(k): v for k, v in dict(configs).items()}
    _RUN["max_turns"] = int(max_turns)


def run_env_config(env_id: str) -> dict[str, Any]:
    """``environment.env_configs.<env_id>`` of the run (empty when unset)."""
    return dict(_RUN["configs"].get(env_id, {}) or {})


def run_max_turns() -> int:
    """``generator.max_turns`` of the run (SkyRL hands it to environments as ``extras["max_turns"]``)."""
    return int(_RUN["max_turns"])


class SkyRLGymEnv(Environment):
    """One trajectory of a SkyRL-Gym environment behind skylift's `Environment` interface."""

    def __init__(self, creator: Callable[..., Any], env_id: str | None, **config: Any) -> None:
        super().__init__(**config)
        self.creator = creator
        self.env_id = env_id
        self.inner: Any = None

    def init(self, prompt: list[Message], extras: dict[str, Any]) -> list[Message]:
        from omegaconf import OmegaConf

        super().init(prompt, extras)
        base = _RUN["configs"].get(self.env_id or "", {}) or {}
        env_config = OmegaConf.create({**_defaults(self.env_id), **dict(base), **self.config})
        env_extras = {**self.extras, "max_turns": _RUN["max_turns"]}
        self.inner = self.creator(env_config=env_config, extras=env_extras)
        out = self.inner.init([dict(m) for m in prompt])
        messages = out[0] if isinstance(out, tuple) else out
        return [dict(m) for m in messages]

    def step(self, action: str) -> StepResult:
        self._begin_step()
        if self.inner is None:
            raise EnvUsageError(f"{type(self).__name__}.step() called before init()")
        out = self.inner.step(action)
        if not isinstance(out, Mapping):
            raise TypeError(f"{type(self.inner).__name__}.step() returned {type(out).__name__}, not a dict")
        metadata = dict(out.get("metadata") or {})
        if out.get("postprocessed_action") is not None:
            metadata["postprocessed_action"] = str(out["postprocessed_action"])
            _warn_postprocessed_once(type(self.inner).__name__)
        done = bool(out.get("done", True))
        metrics = self.inner.get_metrics() if hasattr(self.inner, "get_metrics") else {}
        if metrics:  # SkyRL asks once the rollout ends, however it ends: the last step's is kept
            metadata["env_metrics"] = dict(metrics)
        return StepResult(
            observations=[dict(m) for m in out.get("observations") or []],
            reward=float(out.get("reward") or 0.0),
            done=done,
            metadata=metadata,
        )

    def close(self) -> None:
        if self.inner is not None and hasattr(self.inner, "close"):
            self.inner.close()
        super().close()


def _base_text_env() -> type | None:
    try:
        from skyrl_gym.envs.base_text_env import BaseTextEnv
    except ImportError:
        return None
    return BaseTextEnv


def _registered_id(target: Any) -> str | None:
    """The SkyRL-Gym id whose entry point is `target` (a ``module:Class`` string or the class)."""
    try:
        from skyrl_gym.envs.registration import registry
    except ImportError:
        return None
    for env_id, spec in registry.items():
        entry = spec.entry_point
        if entry is target or (isinstance(target, str) and entry == target):
            return env_id
        if isinstance(target, type) and entry == f"{target.__module__}:{target.__qualname__}":
            return env_id
    return None


def skyrl_gym_factory(name: str) -> Callable[..., Environment] | None:
    """A factory for ``make_env(name, **config)`` from ``module:Class`` or a SkyRL-Gym id, or None."""
    base = _base_text_env()
    if ":" in name:
        module_name, _, attr = name.partition(":")
        if not all(part.isidentifier() for part in module_name.split(".")):
            return None  # another plugin's syntax (tinker-cookbook:...)
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"environment {name!r}: cannot import {attr} from {module_name}: {exc}") from exc
        if isinstance(obj, type) and issubclass(obj, Environment):
            return obj
        if base is not None and isinstance(obj, type) and issubclass(obj, base):
            return GymFactory(obj, _registered_id(name) or _registered_id(obj), name)
        raise TypeError(f"environment {name!r} is neither a skylift Environment nor a SkyRL-Gym BaseTextEnv")
    if base is None:
        return None
    import skyrl_gym

    if name not in skyrl_gym.registry:
        return None
    return GymFactory(lambda **kw: skyrl_gym.make(name, **kw), name, name)


@dataclass(frozen=True)
class GymFactory:
    """``make_env``'s factory of one SkyRL-Gym environment, and how its episodes' metrics combine."""

    creator: Callable[..., Any]
    env_id: str | None
    env_class: str

    def __call__(self, **config: Any) -> SkyRLGymEnv:
        return SkyRLGymEnv(self.creator, self.env_id, **config)

    def aggregate_metrics(self, episodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
        return aggregate_env_metrics(self.env_class, episodes)


def _env_type(env_class: str) -> type | None:
    """The SkyRL-Gym class behind `env_class` (a ``module:Class`` or a SkyRL-Gym id), or None. Only
    SkyRL-Gym environments leave ``env_metrics`` in their metadata, so a name skylift registers
    itself as well (gsm8k) never gets here with episodes."""
    base = _base_text_env()
    if base is None:
        return None
    target: Any = None
    if ":" in env_class:
        target = env_class
    else:
        from skyrl_gym.envs.registration import registry

        spec = registry.get(env_class)
        target = None if spec is None else spec.entry_point
    if isinstance(target, str):
        module_name, _, attr = target.partition(":")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            return None
    return target if isinstance(target, type) and issubclass(target, base) else None


def aggregate_env_metrics(env_class: str, episodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The episodes' ``get_metrics()`` dicts combined as SkyRL does: the SkyRL-Gym class's
    ``aggregate_metrics`` (by default the mean of each numeric field), else the numeric means."""
    env_type = _env_type(env_class)
    if env_type is not None:
        return numeric_only(env_type.aggregate_metrics([dict(m) for m in episodes]))
    return numeric_only(numeric_means(episodes))


register_env_resolver(skyrl_gym_factory)  # after skylift's registered names and the cookbook's prefix
