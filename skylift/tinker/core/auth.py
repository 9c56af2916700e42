"""Who is calling: API keys -> users, and the user of the request being served.

Three modes: an `--api-keys-file` (one ``USER KEY`` pair per line, optionally followed by the
user's caps ``max_clients=N max_adapters=N`` (`UserCaps`), ``#`` comments; SIGHUP
reloads it, so keys are added or revoked without a restart and a revoked key is refused from
the next request on), a single `--api-key` (one user, `DEFAULT_USER`), or no key at all (any key
is accepted, everything belongs to `DEFAULT_USER`). Records written before users existed belong
to `DEFAULT_USER` too (migration 0002).
"""

from __future__ import annotations

import contextvars
import hmac
import logging
import threading
from dataclasses import dataclass, fields
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_USER = "default"

#: The user of the request being served (set by the app's middleware; futures record it).
current_user: contextvars.ContextVar[str | None] = contextvars.ContextVar("tinker_user", default=None)


class KeyFileError(ValueError):
    """An API keys file that cannot be used (the message names the file and line)."""


@dataclass(frozen=True)
class UserCaps:
    """A user's caps on live training clients and LoRA adapters (None: the server's default)."""

    max_clients: int | None = None
    max_adapters: int | None = None


CAP_NAMES = tuple(f.name for f in fields(UserCaps))


def _caps(path: Path, number: int, user: str, items: list[str]) -> UserCaps:
    values: dict[str, int] = {}
    for item in items:
        name, eq, raw = item.partition("=")
        if not eq or name not in CAP_NAMES or not raw.isdigit() or int(raw) < 1:
            raise KeyFileError(
                f"{path}:{number}: expected 'USER KEY' then caps NAME=N (N >= 1, NAME one of "
                f"{', '.join(CAP_NAMES)}), got {item!r}"
            )
        values[name] = int(raw)
    return UserCaps(**values)


def parse_keys_file(path: Path) -> dict[str, str]:
    """{key: user} from a file of ``USER KEY [caps]`` lines."""
    return parse_users_file(path)[0]


def parse_users_file(path: Path) -> tuple[dict[str, str], dict[str, UserCaps]]:
    """({key: user}, {user: caps}) from a file of ``USER KEY [max_clients=N] [max_adapters=N]``
    lines; a user's caps may be on any of its lines, but the same on all that give them."""
    keys: dict[str, str] = {}
    caps: dict[str, UserCaps] = {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"cannot read API keys file {path}: {exc}") from exc
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) < 2:
            raise KeyFileError(f"{path}:{number}: expected 'USER KEY', got {len(parts)} fields")
        user, key = parts[:2]
        if len(parts) > 2:
            mine = _caps(path, number, user, parts[2:])
            if caps.get(user, mine) != mine:
                raise KeyFileError(f"{path}:{number}: user {user!r} has other caps on an earlier line")
            caps[user] = mine
        if key in keys and keys[key] != user:
            raise KeyFileError(f"{path}:{number}: this key is already given to user {keys[key]!r}")
        if not key.startswith("tml-"):
            logger.warning("%s:%d: the tinker SDK only sends keys that start with 'tml-'", path, number)
        keys[key] = user
    return keys, caps


class KeyRing:
    """Resolves an X-API-Key to a user; thread-safe; `reload()` re-reads the keys file."""

    def __init__(self, api_key: str | None = None, keys_file: Path | None = None) -> None:
        if api_key and keys_file:
            raise KeyFileError("give --api-key or --api-keys-file, not both")
        self.keys_file = Path(keys_file) if keys_file else None
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {api_key: DEFAULT_USER} if api_key else {}
        self._caps: dict[str, UserCaps] = {}
        if self.keys_file is not None:
            self._keys, self._caps = parse_users_file(self.keys_file)
            logger.info("%d API keys of %d users from %s", len(self._keys), len(self.users()), self.keys_file)

    @property
    def open(self) -> bool:
        """True when no key is required (every caller is `DEFAULT_USER`)."""
        return self.keys_file is None and not self._keys

    def users(self) -> set[str]:
        with self._lock:
            return set(self._keys.values())

    def reload(self) -> bool:
        """Re-read the keys file; on a broken file keep the previous keys (and log why)."""
        if self.keys_file is None:
            return False
        try:
            keys, caps = parse_users_file(self.keys_file)
        except KeyFileError as exc:
            logger.error("keeping the previous API keys: %s", exc)
            return False
        with self._lock:
            self._keys, self._caps = keys, caps
        logger.info("reloaded %d API keys from %s", len(keys), self.keys_file)
        return True

    def caps_of(self, user: str) -> UserCaps | None:
        """The caps the users file gives `user` (None: the server's defaults)."""
        with self._lock:
            return self._caps.get(user)

    def user_of(self, key: str | None) -> str | None:
        """The user of `key`, None when the key is missing or unknown."""
        if self.open:
            return DEFAULT_USER
        if not key:
            return None
        sent = key.encode()
        with self._lock:
            items = list(self._keys.items())
        user = None
        for known, who in items:  # compare with every key: the time does not tell which matched
            if hmac.compare_digest(sent, known.encode()):
                user = who
        return user
