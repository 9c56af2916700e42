"""A registry of environments by name: ``@register_env("name")``, ``make_env``, ``list_envs``.

The dataset's ``env_class`` column names the environment that scores each prompt. Users add their
own environments by decorating an `Environment` subclass (or a factory returning one)::

    from skylift.envs import Environment, StepResult, register_env

    @register_env("my_task")
    class MyTask(Environment):
        def step(self, action: str) -> StepResult: ...

The module that defines it must be imported before the trainer creates environments.

Other projects' environments (OpenEnv, tinker-cookbook, SkyRL-Gym) are plugins in
``skylift.integrations`` and ``skylift.compat``: this module names them (`_BUILTIN_MODULES`) and
imports them by name on the first lookup, so it never imports them itself. A plugin registers
names (`register_env`), a resolver for names of its own syntax (`register_env_resolver`: e.g.
``tinker-cookbook:package.module:factory``, ``package.module:Class``), what it needs of the run's
``environment`` settings (`register_run_configurer`, called by `configure_run`), and how episodes'
metrics of its environments combine (an ``aggregate_metrics`` attribute of its factory).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from skylift.envs.base import Environment

EnvFactory = Callable[..., Environment]
F = TypeVar("F", bound=EnvFactory)

EnvResolver = Callable[[str], EnvFactory | None]
RunConfigurer = Callable[[Any, int], None]

_REGISTRY: dict[str, EnvFactory] = {}
_RESOLVERS: list[EnvResolver] = []
_CONFIGURERS: list[RunConfigurer] = []
#: Imported in this order on the first lookup; resolvers are asked in the order they register
#: (the cookbook's prefix before ``module:Class``).
_BUILTIN_MODULES = (
    "skylift.envs.gsm8k",
    "skylift.envs.arithmetic",
    "skylift.envs.calculator",
    "skylift.envs.reward_model",
    "skylift.integrations.openenv.env",
    "skylift.integrations.tinker_cookbook.env",
    "skylift.compat.skyrl.gym",
    "skylift.compat.skyrl.geometry3k",  # SkyRL's vision-language examples' environments
    "skylift.compat.skyrl.visgym",
)


class UnknownEnvironmentError(KeyError):
    """No environment is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


def register_env_resolver(resolver: EnvResolver) -> EnvResolver:
    """Add `resolver`: asked for a name no environment is registered under, it returns a factory
    or None (not its syntax). Registering the same resolver twice is a no-op."""
    if resolver not in _RESOLVERS:
        _RESOLVERS.append(resolver)
    return resolver


def register_run_configurer(configurer: RunConfigurer) -> RunConfigurer:
    """Add `configurer`, called by `configure_run` with the run's ``environment`` settings and
    ``generator.max_turns``. Registering the same one twice is a no-op."""
    if configurer not in _CONFIGURERS:
        _CONFIGURERS.append(configurer)
    return configurer


def configure_run(env_class: str, import_modules: Sequence[str], max_turns: int, environment: Any) -> None:
    """Before a run makes environments: import ``environment.import_modules`` and the module of a
    ``module:Class`` `env_class` (``environment.env_class``; for what they register, e.g. SkyRL-Gym
    ids rows name), then hand the ``environment`` settings to every plugin's configurer."""
    _load_builtins()
    modules = list(import_modules or ())
    default = str(env_class or "")
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise ValueError(f"environment.import_modules: cannot import {module!r}: {exc}") from exc
    if ":" in default and default not in _REGISTRY and not any(default.startswith(f"{m}:") for m in modules):
        module = default.partition(":")[0]
        if all(part.isidentifier() for part in module.split(".")):  # not a prefix (tinker-cookbook:)
            try:
                importlib.import_module(module)
            except ImportError as exc:
                raise ValueError(
                    f"environment.env_class={default!r}: cannot import {module!r}: {exc}"
                ) from exc
    for configurer in _CONFIGURERS:
        configurer(environment, int(max_turns))


def aggregate_episode_metrics(env_class: str, episodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Episodes' metrics of environments named `env_class`, combined by its factory's
    ``aggregate_metrics`` when it has one, else each numeric field's mean."""
    try:
        factory: Any = get_env_factory(env_class)
    except (UnknownEnvironmentError, ValueError, TypeError):
        factory = None
    aggregate = getattr(factory, "aggregate_metrics", None)
    out = aggregate([dict(m) for m in episodes]) if callable(aggregate) else numeric_means(episodes)
    return numeric_only(out)


def numeric_means(episodes: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """Each numeric field's mean over the episodes that have it."""
    values: dict[str, list[float]] = {}
    for episode in episodes:
        for key, value in episode.items():
            if isinstance(value, bool | int | float):
                values.setdefault(key, []).append(float(value))
    return {key: sum(v) / len(v) for key, v in values.items()}


def numeric_only(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    """`metrics` as str -> float, its non-numeric values left out."""
    return {str(k): float(v) for k, v in (metrics or {}).items() if isinstance(v, bool | int | float)}


def register_env(name: str, *, override: bool = False) -> Callable[[F], F]:
    """Decorator registering an `Environment` subclass or factory under `name`.

    Registering a different object under a taken name raises ValueError unless `override` is True.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"environment name must be a non-empty string, got {name!r}")

    def decorator(factory: F) -> F:
        if isinstance(factory, type) and not issubclass(factory, Environment):
            raise TypeError(f"{factory.__name__} must subclass skylift.envs.Environment to be registered")
        if not callable(factory):
            raise TypeError(f"register_env({name!r}) needs a class or a callable, got {factory!r}")
        existing = _REGISTRY.get(name)
        if existing is not None and existing is not factory and not override:
            raise ValueError(
                f"environment {name!r} is already registered ({_describe(existing)}); "
                "pass override=True to replace it"
            )
        _REGISTRY[name] = factory
        return factory

    return decorator


def unregister_env(name: str) -> None:
    """Remove `name` from the registry (no error if absent)."""
    _REGISTRY.pop(name, None)


def list_envs() -> list[str]:
    """The registered environment names, sorted."""
    _load_builtins()
    return sorted(_REGISTRY)


def get_env_factory(name: str) -> EnvFactory:
    """The class or factory registered under `name`, else the first a plugin's resolver gives
    (``module:Class``, a SkyRL-Gym id, ``tinker-cookbook:...``); raises UnknownEnvironmentError
    naming the known ones."""
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    for resolver in _RESOLVERS:
        factory = resolver(name)
        if factory is not None:
            return factory
    known = ", ".join(sorted(_REGISTRY)) or "(none)"
    raise UnknownEnvironmentError(
        f"unknown environment {name!r}; registered environments: {known}. Register your own with "
        "@skylift.envs.register_env(name) and import its module first, or name it as package.module:Class "
        "(a skylift Environment or a SkyRL-Gym BaseTextEnv), or tinker-cookbook:package.module:factory."
    )


def make_env(name: str, **config: Any) -> Environment:
    """A new environment instance of the kind registered under `name`, built with `config`."""
    env = get_env_factory(name)(**config)
    if not isinstance(env, Environment):
        raise TypeError(
            f"the factory registered as {name!r} returned {type(env).__name__}, not an Environment"
        )
    return env


def _describe(factory: EnvFactory) -> str:
    module = getattr(factory, "__module__", "?")
    qualname = getattr(factory, "__qualname__", repr(factory))
    return f"{module}.{qualname}"
