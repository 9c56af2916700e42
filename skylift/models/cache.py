"""On-disk cache of prepared models: where it lives, and how a directory is built into it safely.

A prepared model is a directory ``<cache>/models/<name>`` holding a Hugging Face checkpoint and,
written last, a marker file. Building happens in a temporary sibling directory that is renamed into
place, under an exclusive ``fcntl`` lock, so that concurrent processes never see a half-written
model and never build the same one at the same time.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

CACHE_ENV_VAR = "SKYLIFT_CACHE_DIR"
MARKER_FILE = ".skylift-model.json"
DEFAULT_LOCK_TIMEOUT_S = 1800.0


def model_cache_dir() -> Path:
    """Root of skylift's cache: ``$SKYLIFT_CACHE_DIR`` if set, else ``~/.cache/skylift``."""
    env = os.environ.get(CACHE_ENV_VAR)
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "skylift"


def model_dir(name: str, cache_dir: str | Path | None = None) -> Path:
    """Directory where the model ``name`` lives once prepared (``<cache>/models/<name>``)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else model_cache_dir()
    return root / "models" / name


def read_marker(directory: Path) -> dict | None:
    """The completion marker of a prepared directory, or None when it is absent or unreadable."""
    try:
        return json.loads((directory / MARKER_FILE).read_text())
    except (OSError, ValueError):
        return None


def is_complete(directory: Path, recipe_version: int) -> bool:
    """True when ``directory`` was fully prepared by the current version of its recipe."""
    marker = read_marker(directory)
    return marker is not None and marker.get("recipe_version") == recipe_version


@contextlib.contextmanager
def file_lock(path: Path, timeout_s: float = DEFAULT_LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive ``fcntl.flock`` on ``path`` (created if needed), waiting at most ``timeout_s``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(
                        f"could not lock {path} within {timeout_s:.0f} s: another process is still "
                        "preparing this model (remove the lock file if that process is gone)"
                    ) from None
                time.sleep(0.2)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def build_atomically(
    name: str,
    build: Callable[[Path], None],
    recipe_version: int,
    force: bool = False,
    cache_dir: str | Path | None = None,
    lock_timeout_s: float = DEFAULT_LOCK_TIMEOUT_S,
) -> Path:
    """Return the prepared directory of ``name``, calling ``build(tmp_dir)`` first if needed.

    ``build`` writes the model files into an empty directory. The marker is written after it
    returns, then the directory is renamed into place; an existing complete directory is returned
    untouched unless ``force``.
    """
    final = model_dir(name, cache_dir)
    if not force and is_complete(final, recipe_version):
        return final
    parent = final.parent
    parent.mkdir(parents=True, exist_ok=True)
    with file_lock(parent / f".{name}.lock", lock_timeout_s):
        if not force and is_complete(final, recipe_version):
            return final  # another process finished it while we waited for the lock
        # Leftovers of builds that crashed: only lock holders create them, so none is live now.
        for stale in parent.glob(f".{name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=parent))
        try:
            tmp.chmod(0o755)  # mkdtemp makes it private; the cache may be shared
            start = time.perf_counter()
            build(tmp)
            for path in tmp.rglob("*"):  # some writers create files private to their owner
                path.chmod(0o755 if path.is_dir() else 0o644)
            marker = {
                "name": name,
                "recipe_version": recipe_version,
                "build_seconds": round(time.perf_counter() - start, 3),
                "created_unix": int(time.time()),
            }
            (tmp / MARKER_FILE).write_text(json.dumps(marker, indent=2) + "\n")
            if final.exists():
                old = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-old-", dir=parent))
                os.rename(final, old / "model")
                os.rename(tmp, final)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
