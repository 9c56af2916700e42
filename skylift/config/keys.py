"""Introspection of the schema: dotted keys, their types and help texts, and key suggestions."""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from dataclasses import dataclass
from typing import Any

from skylift.config.schema import SkyliftConfig


@dataclass(frozen=True)
class KeyInfo:
    """One dotted key of the tree: a leaf value, or a group of keys."""

    key: str
    annotation: Any
    help: str
    is_group: bool


def _is_dataclass_type(tp: Any) -> bool:
    return isinstance(tp, type) and dataclasses.is_dataclass(tp)


def _walk(cls: type, prefix: str) -> list[KeyInfo]:
    out: list[KeyInfo] = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = hints[f.name]
        group = _is_dataclass_type(tp)
        out.append(KeyInfo(key, tp, f.metadata.get("help", ""), group))
        if group:
            out.extend(_walk(tp, key + "."))
    return out


@functools.cache
def key_table() -> dict[str, KeyInfo]:
    """Every key of the tree (groups and leaves) by dotted name, in schema order."""
    return {info.key: info for info in _walk(SkyliftConfig, "")}


def config_keys() -> list[str]:
    """All dotted leaf keys, e.g. ``trainer.policy.optimizer_config.lr``, in schema order."""
    return [k for k, info in key_table().items() if not info.is_group]


def field_help(key: str) -> str:
    """The help line of a dotted key (leaf or group); KeyError if the key does not exist."""
    return key_table()[key].help


def mapping_leaf_of(key: str) -> str | None:
    """The free-form mapping leaf (e.g. ``environment.env_kwargs``) that ``key`` lies inside, if any."""
    table = key_table()
    parts = key.split(".")
    for i in range(1, len(parts)):
        info = table.get(".".join(parts[:i]))
        if info is not None and not info.is_group and _is_mapping(info.annotation):
            return info.key
    return None


def _is_mapping(tp: Any) -> bool:
    return tp is dict or typing.get_origin(tp) is dict


def is_list_type(tp: Any) -> bool:
    """True for ``list[...]`` and ``list[...] | None`` annotations."""
    args = [a for a in typing.get_args(tp) if a is not type(None)] if _is_union(tp) else [tp]
    return len(args) == 1 and typing.get_origin(args[0]) is list


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def type_name(tp: Any) -> str:
    """A readable name of an annotation: ``int``, ``int or null``, ``list of str``, ``str or list of str``."""
    if tp is type(None):
        return "null"
    if tp is Any:
        return "any value"
    if _is_union(tp):
        args = typing.get_args(tp)
        names = [type_name(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.append("null")
        return " or ".join(names)
    origin = typing.get_origin(tp)
    if origin is list:
        (item,) = typing.get_args(tp) or (Any,)
        return f"list of {type_name(item)}"
    if origin is dict or tp is dict:
        return "mapping"
    return getattr(tp, "__name__", str(tp))


def suggest_keys(key: str, limit: int = 3) -> list[str]:
    """The valid keys closest to a misspelt one, best first.

    A key whose last part exists elsewhere in the tree (``trainer.lr``) suggests those places
    (``trainer.policy.optimizer_config.lr``, ...); otherwise the closest dotted keys, then the keys
    whose last part is closest.
    """
    table = key_table()
    last = key.rsplit(".", 1)[-1]
    top = key.split(".", 1)[0]
    same_name = [k for k in table if k.rsplit(".", 1)[-1] == last and k != key]
    if same_name:
        same_name.sort(key=lambda k: (k.split(".", 1)[0] != top, len(k)))
        return same_name[:limit]
    close = difflib.get_close_matches(key, list(table), n=limit, cutoff=0.75)
    if close:
        return close
    by_last: dict[str, list[str]] = {}
    for cand in table:
        by_last.setdefault(cand.rsplit(".", 1)[-1], []).append(cand)
    names = difflib.get_close_matches(last, list(by_last), n=limit, cutoff=0.75)
    found = [cand for name in names for cand in by_last[name]]
    found.sort(key=lambda k: k.split(".", 1)[0] != top)
    return found[:limit]
