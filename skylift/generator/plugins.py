"""Generators that stand in for skylift's own when a group of the ``environment`` settings asks.

``environment.verifiers`` (a verifiers env server plays its rows) is one: the plugin lives in
``skylift.integrations.verifiers``, which this module names (`_BUILTIN_MODULES`) and imports by
name on first use, so the core never imports it. A plugin registers a `RolloutPlugin` under the
settings group it reads (`register_rollout_plugin`); `rollout_plugin` finds the one the run's
settings turn on (checking its options before anything starts) and `RolloutPlugin.wrap` builds
the run's generator around skylift's own.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, is_dataclass
from typing import Any, Protocol

from skylift.generator.generator import Generator

#: plugins of the integrations wing, which the core reaches only by name (skylift's own gateway
#: registers its plugin when the runtime, a layer above it, imports it)
_BUILTIN_MODULES = ("skylift.integrations.verifiers.rollouts",)
_PLUGINS: dict[str, RolloutPlugin] = {}


@dataclass(frozen=True)
class RolloutContext:
    """What a plugin's generator gets of the run besides skylift's generator."""

    engine_urls: list[str]  # the engines' HTTP servers (those that have one)
    default_env_class: str  # environment.env_class
    renderer_model: str  # the policy's model directory (its tokenizer and chat template)
    api_key: str | None  # the engines' API key, if any


class RolloutPlugin(Protocol):
    def check(self, options: dict[str, Any]) -> Any | None:
        """The plugin's settings from its ``environment.<group>`` options (None: turned off);
        raises ValueError naming a bad option."""
        ...

    def wrap(self, generator: Generator, settings: Any, context: RolloutContext) -> Any:
        """The run's generator (``generate(rows, n, params, engine_version, seeds)``, optionally
        ``aclose()``) around skylift's `generator`."""
        ...


def register_rollout_plugin(group: str, plugin: RolloutPlugin) -> None:
    """Register `plugin` for the settings group ``environment.<group>`` (re-registering replaces)."""
    _PLUGINS[group] = plugin


def rollout_plugin(environment: Any) -> tuple[RolloutPlugin, Any] | None:
    """The plugin the run's ``environment`` settings turn on, with its checked settings, or None;
    more than one turned on is refused."""
    for module in _BUILTIN_MODULES:
        importlib.import_module(module)
    found = []
    for group, plugin in sorted(_PLUGINS.items()):
        options = getattr(environment, group, None)
        settings = plugin.check(options if is_dataclass(options) else dict(options or {}))
        if settings is not None:
            found.append((group, plugin, settings))
    if len(found) > 1:
        raise ValueError(f"environment: only one of {', '.join(g for g, _, _ in found)} can be set")
    return (found[0][1], found[0][2]) if found else None
