"""A registry of environments by name: ``@register_env("name")``, ``make_env``, ``list_envs``.

The dataset's ``env_class`` column names the environment that scores each prompt. Users add their
own environments by decorating an `Environment` subclass (or a factory returning one)::

    from skylift.envs import Environment, StepResult, register_env

    @register_env("my_task")
    class MyTask(Environment):
        def step(self, action: str) -> StepResult: ...

The module that defines it must be imported before the trainer creates environments.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any, TypeVar

from skylift.envs.base import Environment

EnvFactory = Callable[..., Environment]
F = TypeVar("F", bound=EnvFactory)

_REGISTRY: dict[str, EnvFactory] = {}
_BUILTIN_MODULES = (
    "skylift.envs.gsm8k",
    "skylift.envs.arithmetic",
    "skylift.envs.calculator",
    "skylift.envs.openenv",
)


class UnknownEnvironmentError(KeyError):
    """No environment is registered under the requested name."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0])


def _load_builtins() -> None:
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)


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
    """The class or factory registered under `name`, else one of `skylift.envs.skyrl_gym` (``module:Class``
    or a SkyRL-Gym id); raises UnknownEnvironmentError naming the known ones."""
    _load_builtins()
    if name in _REGISTRY:
        return _REGISTRY[name]
    from skylift.envs.tinker_cookbook import PREFIX, cookbook_factory

    if name.startswith(PREFIX):  # tinker-cookbook:package.module:factory (an EnvGroupBuilder's)
        return cookbook_factory(name)
    from skylift.envs.skyrl_gym import skyrl_gym_factory  # module:Class, or a SkyRL-Gym id

    factory = skyrl_gym_factory(name)
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
