"""How a schema field is declared: a default, a help line and its own `Bounds`."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Bounds:
    """The values one leaf accepts (null always passes): ``ge``/``gt``/``le``/``lt`` bounds, one of
    ``choices`` (each item for a list), or ``or_minus_one``: >= 1 or -1 (the words say what -1 does)."""

    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    choices: tuple[str, ...] | None = None
    or_minus_one: str | None = None

    def problem(self, key: str, value: Any) -> str | None:
        """What is wrong with ``key=value``, or None."""
        if value is None:
            return None
        if self.choices is not None:
            bad = [v for v in (value if isinstance(value, list) else [value]) if v not in self.choices]
            return f"{key}={bad[0]!r} is not one of {', '.join(self.choices)}" if bad else None
        if self.or_minus_one is not None:
            return (
                None
                if value == -1 or value >= 1
                else f"{key}={value} must be >= 1, or -1 {self.or_minus_one}"
            )
        low, high = self.ge if self.ge is not None else self.gt, self.le if self.le is not None else self.lt
        too_low = (self.ge is not None and value < self.ge) or (self.gt is not None and value <= self.gt)
        too_high = (self.le is not None and value > self.le) or (self.lt is not None and value >= self.lt)
        if not (too_low or too_high):
            return None
        if high is None:
            return f"{key}={value} must be {'>=' if self.ge is not None else '>'} {_num(low)}"
        if low is None:
            return f"{key}={value} must be {'<=' if self.le is not None else '<'} {_num(high)}"
        left, right = "[" if self.ge is not None else "(", "]" if self.le is not None else ")"
        return f"{key}={value} must be in {left}{_num(low)}, {_num(high)}{right}"


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else str(x)


def _f(default: Any, help: str, **bounds: Any) -> Any:
    """A leaf field with a default value, a help line and optional `Bounds` (``ge=1``, ``choices=...``);
    mutable defaults are copied per instance."""
    metadata = {"help": help, "bounds": Bounds(**bounds)} if bounds else {"help": help}
    if isinstance(default, list | dict):
        return field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return field(default=default, metadata=metadata)


def _group(cls: type, help: str, **kwargs: Any) -> Any:
    """A nested group field built by ``cls(**kwargs)`` with a help line."""
    return field(default_factory=lambda: cls(**kwargs), metadata={"help": help})
