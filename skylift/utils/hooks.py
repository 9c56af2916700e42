"""Hook points: lists of callables that other modules add to, the built-in ones named by module.

A hook's built-in modules are dotted names, imported (importlib) the first time the hook's
callables are asked for, in whichever process asks (the driver, a Ray worker). This is how the
core reaches the compatibility wing (``skylift.compat``, ``skylift.integrations``) without an
import arrow: the wing's modules register themselves when imported.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

T = TypeVar("T", bound=Callable[..., object])


class Hook(Generic[T]):
    """The callables of one hook point (`kind` names it in messages)."""

    def __init__(self, kind: str, builtin_modules: Sequence[str] = ()) -> None:
        self.kind = kind
        self.builtin_modules = tuple(builtin_modules)
        self._items: list[T] = []
        self._loaded = False

    def register(self, fn: T) -> T:
        """Add `fn` (a decorator; adding the same callable twice is a no-op)."""
        if not callable(fn):
            raise TypeError(f"{self.kind}: {fn!r} is not callable")
        if fn not in self._items:
            self._items.append(fn)
        return fn

    def unregister(self, fn: T) -> None:
        """Remove `fn` (no error when absent)."""
        if fn in self._items:
            self._items.remove(fn)

    def items(self) -> list[T]:
        """The registered callables, in order, after importing the built-in modules once."""
        if not self._loaded:
            self._loaded = True
            for module in self.builtin_modules:
                importlib.import_module(module)
        return list(self._items)
