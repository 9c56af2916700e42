"""The one exception type of the configuration system."""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration problem: unknown key, wrong type, malformed override or invalid combination.

    ``key`` is the dotted key at fault (None when the problem is not about one key), ``suggestions``
    the closest valid keys for an unknown one, and ``problems`` every message when several semantic
    checks failed at once.
    """

    def __init__(
        self,
        message: str,
        *,
        key: str | None = None,
        suggestions: list[str] | None = None,
        problems: list[str] | None = None,
    ) -> None:
        super().__init__(message)
        self.key = key
        self.suggestions = list(suggestions or [])
        self.problems = list(problems or [message])
