"""Other projects' key names on skylift's loader: dialects, registered by name.

A dialect is a class the loader makes one instance of per load (`load_config`); it names other
spellings of skylift keys (`KeyDialect.ALIASES`), refuses what skylift does not have before any key
is set (`refuse`), reads values (`value`), takes keys it handles itself (`take`: set aside, or
collected for `translations` into skylift keys once every assignment is in), explains a key the
schema does not know (`unknown_key`) and warns at the end (`warn`). The built-in dialect
(``skylift.compat.skyrl.keys``) is named here and imported by name on the first load.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, ClassVar, Protocol

from skylift.utils.hooks import Hook


class KeyDialect(Protocol):
    ALIASES: ClassVar[Mapping[str, str]]  # other name -> skylift key
    TRANSLATION_SOURCE: ClassVar[str]  # what an error in a translated key names as its source

    def refuse(self, assignments: Iterable[tuple[str, Any]]) -> None:
        """Raise ConfigError for an assignment no load of this dialect can take (checked first)."""
        ...

    def value(self, key: str, value: Any) -> Any:
        """The skylift value of ``key=value``."""
        ...

    def take(self, key: str, value: Any, source: str) -> bool:
        """Whether the dialect handles ``key=value`` itself (the schema does not see it)."""
        ...

    def translations(self) -> list[tuple[str, Any]]:
        """skylift assignments for what the dialect collected."""
        ...

    def unknown_key(self, key: str, source: str) -> str | None:
        """The message for a key the schema does not know, when the dialect knows why; else None."""
        ...

    def warn(self) -> list[str]:
        """Log the end-of-load warnings; returns the keys warned about."""
        ...


DIALECTS: Hook[Callable[[], KeyDialect]] = Hook("config dialect", ("skylift.compat.skyrl.keys",))


def start_dialects() -> list[KeyDialect]:
    """One fresh instance of every registered dialect, for one load."""
    return [make() for make in DIALECTS.items()]


def key_aliases() -> dict[str, str]:
    """Every dialect's other names of skylift keys."""
    out: dict[str, str] = {}
    for make in DIALECTS.items():
        out.update(getattr(make, "ALIASES", {}))
    return out
