"""Who is calling: API keys -> users, and the user of the request being served.

Three modes: an `--api-keys-file` (one ``USER KEY`` pair per line, ``#`` comments; SIGHUP
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
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_USER = "default"

#: The user of the request being served (set by the app's middleware; futures record it).
current_user: contextvars.ContextVar[str | None] = contextvars.ContextVar("tinker_user", default=None)


class KeyFileError(ValueError):
    """An API keys file that cannot be used (the message names the file and line)."""


def parse_keys_file(path: Path) -> dict[str, str]:
    """{key: user} from a file of ``USER KEY`` lines."""
    keys: dict[str, str] = {}
    try:
        text = path.read_text()
    except OSError as exc:
        raise KeyFileError(f"cannot read API keys file {path}: {exc}") from exc
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2:
            raise KeyFileError(f"{path}:{number}: expected 'USER KEY', got {len(parts)} fields")
        user, key = parts
        if key in keys and keys[key] != user:
            raise KeyFileError(f"{path}:{number}: this key is already given to user {keys[key]!r}")
        if not key.startswith("tml-"):
            logger.warning("%s:%d: the tinker SDK only sends keys that start with 'tml-'", path, number)
        keys[key] = user
    return keys


class KeyRing:
    """Resolves an X-API-Key to a user; thread-safe; `reload()` re-reads the keys file."""

    def __init__(self, api_key: str | None = None, keys_file: Path | None = None) -> None:
        if api_key and keys_file:
            raise KeyFileError("give --api-key or --api-keys-file, not both")
        self.keys_file = Path(keys_file) if keys_file else None
        self._lock = threading.Lock()
        self._keys: dict[str, str] = {api_key: DEFAULT_USER} if api_key else {}
        if self.keys_file is not None:
            self._keys = parse_keys_file(self.keys_file)
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
            keys = parse_keys_file(self.keys_file)
        except KeyFileError as exc:
            logger.error("keeping the previous API keys: %s", exc)
            return False
        with self._lock:
            self._keys = keys
        logger.info("reloaded %d API keys from %s", len(keys), self.keys_file)
        return True

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
