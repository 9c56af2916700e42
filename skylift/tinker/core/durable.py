"""Crash-safe files: a checkpoint directory or a metadata file is written under a temporary
name, fsynced, then renamed into place (and its parent directory fsynced), so that a crash
leaves either the old complete version or the new complete one, never half of one."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from skylift.utils.durable_files import fsync_dir, write_bytes_atomic

#: Separates a checkpoint's name from a version tag in its directory name ('#' is never part of a
#: checkpoint name, see `skylift.tinker.storage.views.check_name`).
VERSION_SEP = "#"


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under `root` (and `root` itself)."""
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fd = os.open(os.path.join(dirpath, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(dirpath))


def staging_dir(final: Path) -> Path:
    """A fresh sibling of `final` to write a new version into."""
    return final.with_name(f"{final.name}{VERSION_SEP}{uuid.uuid4().hex[:12]}")


def commit_dir(staging: Path, final: Path) -> Path:
    """Make the fully written `staging` durable and give it its final place: renamed to `final`
    when that is free, else kept where it is (the record switches to it; the caller deletes the
    old version afterwards). Returns where the new version lives."""
    fsync_tree(staging)
    if not final.exists():
        os.rename(staging, final)
        fsync_dir(final.parent)
        return final
    fsync_dir(staging.parent)
    return staging


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8), crash-safe (`skylift.utils.durable_files`)."""
    write_bytes_atomic(path, text.encode("utf-8"))
