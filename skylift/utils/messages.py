"""Messages for people: an error's cause on one line, without terminal colours or tracebacks.

An exception that crossed a process boundary often carries its whole remote traceback in its
text (Ray's `RayTaskError`: a coloured ``ray::Actor.method()`` header, the frames, then the
error). A message that tells a user what stopped keeps only the sentences; the detail belongs in
the log.
"""

from __future__ import annotations

import re
import sys
import traceback
from typing import Any

#: Terminal escape sequences (colours, cursor moves): CSI ``ESC [ ... letter`` and two-byte ones.
_ANSI = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")

#: Lines of a traceback or of Ray's remote-error header: never part of the cause.
_NOISE = re.compile(
    r"^(Traceback \(most recent call last\):|The above exception was the direct cause"
    r"|During handling of the above exception|ray::\S+\(\)|\^+$|~+\^*~*$)"
)


def plain(text: str) -> str:
    """`text` without terminal escape sequences."""
    return _ANSI.sub("", text)


def one_line(text: str) -> str:
    """`text` as one line: escape sequences, traceback frames (indented lines), traceback and Ray
    header lines dropped, the remaining lines joined with a space."""
    kept = []
    for line in plain(text).splitlines():
        if not line.strip() or line[:1].isspace() or _NOISE.match(line.strip()):
            continue
        kept.append(line.strip())
    return " ".join(kept) if kept else plain(text).strip()


def said(prog: str, line: str, exc: BaseException, code: int, verbose: bool) -> int:
    """Print `line` after `prog` on stderr (the traceback of `exc` before it when `verbose`); `code`,
    the exit code a command returns with it."""
    if verbose:
        traceback.print_exception(exc, file=sys.stderr)
    print(f"{prog}: {line}", file=sys.stderr)
    return code


def config_error(exc: Any) -> str:
    """One line of a `pydantic.ValidationError` that vLLM's config classes raise on settings they
    refuse: the messages of its errors, without pydantic's input dump and links."""
    errors = exc.errors() if hasattr(exc, "errors") else []
    messages = [str(e.get("msg", "")).removeprefix("Value error, ") for e in errors] or [str(exc)]
    return "; ".join(m.strip().rstrip(".") for m in messages if m.strip()) or type(exc).__name__
