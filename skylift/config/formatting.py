"""Rendering a ``SkyliftConfig``: YAML text (optionally with help comments) and plain dicts."""

from __future__ import annotations

import dataclasses
from typing import Any

import yaml

from skylift.config.keys import field_help
from skylift.config.schema import SkyliftConfig


def to_dict(cfg: Any) -> dict[str, Any]:
    """The tree as nested plain dicts and lists (a deep copy)."""
    if not dataclasses.is_dataclass(cfg) or isinstance(cfg, type):
        raise TypeError(f"to_dict needs a config dataclass instance, got {type(cfg).__name__}")
    return dataclasses.asdict(cfg)


_DERIVED_ATTR = "_skylift_derived"


def set_derived_keys(cfg: SkyliftConfig, derived: dict[str, Any]) -> None:
    """Remember which keys ``load_config`` derived from null, so that ``format_config`` keeps them null."""
    object.__setattr__(cfg, _DERIVED_ATTR, dict(derived))


def format_config(cfg: SkyliftConfig, with_help: bool = False) -> str:
    """The tree as YAML, loadable again with ``load_config(config_file=...)`` to the same config.

    Keys that ``load_config`` derived from null (reference model path, output directories, ...) and
    that still hold the derived value are written as ``null  # = <value> (derived)``, so a reloaded
    file derives them again from the keys they follow. With ``with_help=True`` every line ends with
    ``  # <help text>`` of its key.
    """
    derived: dict[str, Any] = getattr(cfg, _DERIVED_ATTR, {})
    lines: list[str] = []
    _emit(cfg, "", 0, with_help, derived, lines)
    return "\n".join(lines) + "\n"


def _emit(
    node: Any, prefix: str, depth: int, with_help: bool, derived: dict[str, Any], lines: list[str]
) -> None:
    indent = "  " * depth
    for f in dataclasses.fields(node):
        value = getattr(node, f.name)
        key = f"{prefix}{f.name}"
        notes = []
        if key in derived and derived[key] == value:
            notes.append(f"= {_scalar(value)} (derived)")
            value = None
        if with_help and field_help(key):
            notes.append(field_help(key))
        comment = f"  # {'; '.join(notes)}" if notes else ""
        if dataclasses.is_dataclass(value):
            lines.append(f"{indent}{f.name}:{comment}")
            _emit(value, key + ".", depth + 1, with_help, derived, lines)
        else:
            lines.append(f"{indent}{f.name}: {_scalar(value)}{comment}")


def _scalar(value: Any) -> str:
    """One value in YAML flow style on a single line (strings quoted only when YAML needs it)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9, allow_unicode=True).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    elif text.endswith("..."):
        text = text[:-3].rstrip()
    return text
