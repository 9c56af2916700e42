"""Writing a checkpoint: crash-safe on disk, then recorded, within its owner's disk share.

`CheckpointWriter` is what the training operations (save_weights, save_weights_for_sampler) and
the checkpoint operations (save_weights_external) write through. Its collaborators are explicit:
the store, the database thread (`db`), the training thread (`run_training`: the weights are
written there), where a run's checkpoint lives (`run_dir`) and the per-user disk share.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from skylift.tinker.core import durable
from skylift.tinker.core.fairness import QuotaError
from skylift.tinker.storage.store import CheckpointRow, Store
from skylift.tinker.storage.views import KIND_SEGMENT, tinker_path

#: db(fn, *args): a blocking store call on a worker thread
Db = Callable[..., Awaitable[Any]]
#: run_training(fn, *args): `fn(*args)` on the training thread, in the calling user's turn
RunTraining = Callable[..., Awaitable[Any]]


def disk_quota(store: Any, gb_per_user: float, owner: str | None, adding: int) -> None:
    """Refuse (429) a new checkpoint of `owner` once its checkpoints use its share of the disk
    (``--max-checkpoint-gb-per-user``); `adding` bytes known in advance count too (blocking:
    reads records)."""
    if owner is None:
        return
    used = sum(int(r.size_bytes or 0) for r in store.checkpoints(owner=owner))
    quota = int(gb_per_user * 1024**3)
    if used + adding > quota or (adding == 0 and used >= quota):
        raise QuotaError(
            f"your checkpoints use {used / 1024**3:.2f} GiB of the {quota / 1024**3:g} GiB this server allows "
            "per user (--max-checkpoint-gb-per-user); delete checkpoints you no longer need"
        )


class CheckpointWriter:
    """Writes and records checkpoints (see the module docstring for its collaborators)."""

    def __init__(
        self,
        *,
        store: Store,
        db: Db,
        run_training: RunTraining,
        run_dir: Callable[[str, str, str], Path],
        gb_per_user: float,
    ) -> None:
        self.store = store
        self.db = db
        self.run_training = run_training
        self.run_dir = run_dir
        self.gb_per_user = gb_per_user

    async def write(
        self,
        writer: Any,
        model_id: str,
        kind: str,
        name: str,
        expires_at: dt.datetime | None,
        user_metadata: Any = None,
    ) -> tuple[str, int]:
        """Write checkpoint `name` of kind `kind` afresh with `writer(directory) -> size` (on the
        training thread) and record it; (its tinker path, its size). Crash-safe: the new version is
        written under a temporary name, fsynced and renamed, then recorded; an old version (an
        overwrite) stays complete and recorded until then, and is deleted after."""
        path = tinker_path(model_id, kind, name)
        await self.db(lambda: disk_quota(self.store, self.gb_per_user, self.store.model_owner(model_id), 0))
        final = self.run_dir(model_id, kind, name)
        staging = durable.staging_dir(final)
        try:
            size = await self.run_training(writer, staging)
            directory = await asyncio.to_thread(durable.commit_dir, staging, final)
        except BaseException:
            await asyncio.to_thread(shutil.rmtree, staging, True)
            raise
        old = await self.db(self.store.checkpoint, path)
        row = CheckpointRow(
            tinker_path=path,
            model_id=model_id,
            checkpoint_id=f"{KIND_SEGMENT[kind]}/{name}",
            kind=kind,
            directory=str(directory),
            size_bytes=size,
            expires_at=expires_at,
            user_metadata=user_metadata,
        )
        await self.db(self.store.put_checkpoint, row)
        if old is not None and Path(old.directory) != directory:
            await asyncio.to_thread(shutil.rmtree, old.directory, True)
        return path, size
