"""Shared-memory segments of CPU weight buffers: files under /dev/shm that skylift makes and names.

A sender's buffer is a file ``/dev/shm/skylift_w_<pid>_<random>`` it creates, sizes and maps
(`create_segment`); a receiver on the same host maps the same file by name (`open_segment`). No
helper process is involved: torch's own ``file_system`` sharing starts a ``torch_shm_manager``
beside every sender and talks to it over a socket at each allocation, so a manager that died under
a live process (or outlived a dead one) broke the next push ("Connection reset by peer", "Broken
pipe"). Lifetime: the file is unlinked when the sender's last reference to its mapping goes
(`weakref.finalize`, also at interpreter exit); pages stay until every process that mapped them
unmaps. A sender killed outright leaves its files behind: the next `create_segment` on the host
removes those whose process is gone (`sweep_stale`).

Standard library and torch only (a GPU machine with nothing but torch runs it).
"""

from __future__ import annotations

import mmap
import os
import re
import secrets
import weakref

import torch

SHM_DIR = "/dev/shm"
_PREFIX = "skylift_w_"
#: a segment's name: the sender's pid, then 16 random hex digits
SEGMENT_NAME = re.compile(rf"{_PREFIX}(\d+)_[0-9a-f]{{16}}")


def _segment_path(name: str) -> str:
    if not SEGMENT_NAME.fullmatch(name):
        raise ValueError(f"shared tensors: {name!r} is not a skylift shared-memory segment name")
    return os.path.join(SHM_DIR, name)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale() -> list[str]:
    """Remove the segments of senders that no longer run (killed before they could unlink them);
    the names removed."""
    removed = []
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return removed
    for name in names:
        match = SEGMENT_NAME.fullmatch(name)
        if match and not _pid_alive(int(match.group(1))):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
                removed.append(name)
            except OSError:
                pass  # another sweeper got there first, or not ours to remove
    return removed


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def free_bytes() -> int:
    """Bytes free in /dev/shm (`OSError` when it is not usable)."""
    stat = os.statvfs(SHM_DIR)
    return stat.f_bavail * stat.f_frsize


def check_room(nbytes: int) -> None:
    """Refuse, in one line, CPU buffers that /dev/shm cannot hold (a container's default is 64
    MB): writing past a full tmpfs kills the writer with SIGBUS instead of raising."""
    if nbytes <= 0:
        return
    try:
        free = free_bytes()
    except OSError as exc:
        raise RuntimeError(
            f"shared tensors: {SHM_DIR} is not usable ({exc}); use a group backend (gloo)"
        ) from exc
    if nbytes > free:
        raise RuntimeError(
            f"shared tensors: {nbytes / 2**20:.0f} MiB do not fit in {SHM_DIR} ({free / 2**20:.0f} MiB free): "
            "enlarge it (docker run --shm-size) or use generator.weight_sync_backend=gloo"
        )


def create_segment(nbytes: int) -> tuple[torch.UntypedStorage, str]:
    """A new zero-filled segment of `nbytes` (pages touched only as written), mapped here: (its
    storage, its name for `open_segment`). Unlinked when the storage's last reference goes."""
    sweep_stale()
    name = f"{_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, max(nbytes, 1))
        mapped = mmap.mmap(fd, max(nbytes, 1))
    except BaseException:
        _unlink(path)
        raise
    finally:
        os.close(fd)
    weakref.finalize(mapped, _unlink, path)
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes).untyped_storage(), name


def open_segment(name: str, nbytes: int) -> torch.UntypedStorage:
    """Map the sender's segment `name` (`create_segment`'s) here: `nbytes` of its storage. The
    mapping outlives the file's unlinking and the sender."""
    path = _segment_path(name)
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError as exc:
        raise RuntimeError(
            f"shared tensors: segment {path} is gone (the sender released its buffers or exited)"
        ) from exc
    try:
        size = os.fstat(fd).st_size
        if size != max(nbytes, 1):
            raise RuntimeError(f"shared tensors: segment {path} holds {size} bytes, the handle says {nbytes}")
        mapped = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    if nbytes == 0:
        return torch.UntypedStorage(0)
    return torch.frombuffer(mapped, dtype=torch.uint8, count=nbytes).untyped_storage()


__all__ = [
    "SEGMENT_NAME",
    "SHM_DIR",
    "check_room",
    "create_segment",
    "free_bytes",
    "open_segment",
    "sweep_stale",
]
