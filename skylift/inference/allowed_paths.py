"""Where a client may point the server's checkpoint-delta sync: roots set at start-up.

``/skylift/delta/fetch`` and ``/skylift/delta/load`` read the directory (or bucket) a request
names as ``sync_dir`` and write the store it names as ``local_checkpoint_dir``. A server must not
read and write whatever a client says, so both must lie under a root given when the server starts
(``skylift serve --delta-sync-root DIR_OR_URI``, repeatable; like vLLM's
``--allowed-local-media-path``). A local root is a directory (paths are compared after resolving
``..`` and symlinks); a ``gs://`` / ``s3://`` root allows the URIs under that prefix. A path that
is not under a root, or that no file system could hold (a component over 255 bytes, 4096 bytes
in all), is refused before anything is opened, with a message naming the roots.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

#: Longest path, and path component, the check lets through (Linux's PATH_MAX and NAME_MAX).
MAX_PATH_BYTES = 4096
MAX_NAME_BYTES = 255
CLOUD_SCHEMES = ("gs://", "s3://")
ROOT_FLAG = "--delta-sync-root"


class PathNotAllowed(ValueError):
    """A client's path that the server does not read or write; `status` is the HTTP answer."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def _is_uri(path: str) -> bool:
    return path.startswith(CLOUD_SCHEMES)


@dataclass(frozen=True)
class AllowedRoots:
    """The roots a client's delta-sync paths must lie under (none: every path is refused)."""

    local: tuple[Path, ...] = ()
    uris: tuple[str, ...] = ()

    @classmethod
    def from_flags(cls, roots: list[str] | tuple[str, ...] | None) -> AllowedRoots:
        """From ``--delta-sync-root`` values; `ValueError` for a local root that is no directory."""
        local: list[Path] = []
        uris: list[str] = []
        for root in roots or ():
            if _is_uri(root):
                uris.append(root.rstrip("/") + "/")
                continue
            path = Path(root).expanduser().resolve()
            if not path.is_dir():
                raise ValueError(f"{ROOT_FLAG} {root}: not a directory on this host")
            local.append(path)
        return cls(tuple(local), tuple(uris))

    def describe(self) -> str:
        names = [str(p) for p in self.local] + list(self.uris)
        return ", ".join(names) if names else "none"

    def _refuse(self, field: str, path: str, why: str) -> PathNotAllowed:
        if not self.local and not self.uris:
            return PathNotAllowed(
                f"{field} {path[:200]!r}: this server accepts no delta-sync paths (start it with "
                f"{ROOT_FLAG} DIR or {ROOT_FLAG} s3://bucket/prefix)",
                403,
            )
        return PathNotAllowed(f"{field} {path[:200]!r} {why} (allowed roots: {self.describe()})", 403)

    def check(self, field: str, path: str) -> str:
        """`path` as the server will use it (resolved), or `PathNotAllowed` naming the roots."""
        raw = path.encode("utf-8", "surrogatepass")
        if (
            len(raw) > MAX_PATH_BYTES
            or any(len(part) > MAX_NAME_BYTES for part in raw.split(b"/"))
            or "\0" in path
        ):
            raise PathNotAllowed(
                f"{field}: not a usable path ({len(raw)} bytes; at most {MAX_PATH_BYTES} in all and "
                f"{MAX_NAME_BYTES} per component, no NUL)",
                400,
            )
        if _is_uri(path):
            if any(path.rstrip("/") + "/" == root or path.startswith(root) for root in self.uris):
                return path
            raise self._refuse(field, path, "is not under an allowed bucket prefix")
        if "://" in path:
            raise PathNotAllowed(
                f"{field} {path[:200]!r}: only local paths, gs:// and s3:// URIs are read", 400
            )
        resolved = Path(os.path.realpath(os.path.expanduser(path)))
        if any(resolved == root or resolved.is_relative_to(root) for root in self.local):
            return str(resolved)
        raise self._refuse(field, path, "is not under an allowed directory")
