"""Name -> callable registries users extend: advantage estimators and policy losses.

They live in the lowest layer so that the configuration can check a configured name against what
user modules registered (``trainer.algorithm.import_modules``) without importing the algorithms;
`skylift.algorithms` registers the built-ins into the same two registries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T", bound=Callable[..., object])


class UnknownNameError(ValueError):
    """Raised when a registry is asked for a name it does not hold; the message lists the known names."""


class Registry(Generic[T]):
    """Maps names to callables of one kind (`kind` names that kind in error messages)."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._items: dict[str, T] = {}

    def register(self, name: str, *, override: bool = False) -> Callable[[T], T]:
        """Decorator that registers a callable under `name`; re-registering needs `override=True`."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"{self.kind} name must be a non-empty string, got {name!r}")

        def decorator(fn: T) -> T:
            if name in self._items and not override:
                raise ValueError(
                    f"{self.kind} {name!r} is already registered; pass override=True to replace it"
                )
            self._items[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> T:
        """The callable registered under `name`."""
        try:
            return self._items[name]
        except KeyError:
            raise UnknownNameError(
                f"unknown {self.kind} {name!r}; known: {', '.join(sorted(self._items))}"
            ) from None

    def unregister(self, name: str) -> None:
        """Remove `name` (e.g. a test's temporary entry); unknown names raise like `get`."""
        self.get(name)
        del self._items[name]

    def names(self) -> list[str]:
        """All registered names, sorted."""
        return sorted(self._items)

    def __contains__(self, name: object) -> bool:
        return name in self._items


ADVANTAGE_ESTIMATOR_REGISTRY: Registry = Registry("advantage estimator")
"""Advantage estimators by name (`skylift.algorithms.register_advantage_estimator` fills it)."""

POLICY_LOSS_REGISTRY: Registry = Registry("policy loss")
"""Policy losses by name (`skylift.algorithms.register_policy_loss` fills it)."""
