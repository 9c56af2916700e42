"""Importing the user modules a run names (for what they register: estimators, losses, environments).

A module is looked up on ``sys.path`` first, then in the directory the run was started from, as
``python -m`` would find it: ``skylift train`` is a console script, whose ``sys.path`` does not hold
the current directory, and a Ray worker starts elsewhere.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence


class PluginImportError(ImportError):
    """A module a config key lists could not be imported; the message names the key and the module."""


def import_user_modules(modules: Sequence[str], key: str, search_dir: str | None = None) -> None:
    """Import each of `modules` (a no-op for those already imported).

    `key` is the config key that listed them (for the error message); `search_dir` (default: the
    current directory) is put on ``sys.path`` when a module is not found without it.
    """
    for module in modules:
        if module in sys.modules:
            continue
        try:
            importlib.import_module(module)
            continue
        except ModuleNotFoundError as exc:
            top = module.split(".", 1)[0]
            if exc.name not in (top, module):
                raise PluginImportError(f"{key}: importing {module!r} failed: {exc}") from exc
        except Exception as exc:  # a module that raises while it runs: say which one
            raise PluginImportError(
                f"{key}: importing {module!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
        where = os.path.abspath(search_dir or os.getcwd())
        if where not in sys.path:
            sys.path.append(where)
        try:
            importlib.import_module(module)
        except Exception as exc:
            raise PluginImportError(
                f"{key}: cannot import {module!r} (looked on sys.path and in {where}): "
                f"{type(exc).__name__}: {exc}"
            ) from exc
