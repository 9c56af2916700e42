"""Errors of the Tinker service and how they reach the client.

A failed future is answered as ``{"error": message, "category": "user" | "server" | "unknown"}``;
`UserError` marks mistakes in the request (unknown model id, bad shapes, unknown loss), every
other exception is a server error.
"""

from __future__ import annotations


class UserError(ValueError):
    """The request is wrong; the message says what and how to fix it (category "user")."""


class NotFoundError(UserError):
    """A referenced id or path does not exist."""


class TooLargeError(UserError):
    """The request is larger than one of this server's limits (HTTP 413); the message names the
    limit and the option that raises it."""


def unknown(what: str, key: object) -> NotFoundError:
    """The error of an id that names nothing (or another user's record): "unknown <what> <key>"."""
    return NotFoundError(f"unknown {what} {key!r}")


def missing_checkpoint(path: object, what: str = "checkpoint") -> NotFoundError:
    """The error of a `tinker://` path that names no checkpoint (or another user's)."""
    return NotFoundError(f"{what} {path} does not exist")


def error_category(exc: BaseException) -> str:
    """The Tinker error category of an exception."""
    return "user" if isinstance(exc, UserError) else "server"


def error_message(exc: BaseException) -> str:
    """A one-line message naming the exception type when it is not ours."""
    if isinstance(exc, UserError):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"
