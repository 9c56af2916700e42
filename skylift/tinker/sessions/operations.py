"""`SessionOperations`: a client's session from creation to its end, and the cleanup that ends
the sessions whose heartbeats stopped.

A session's end (asked for, or missed heartbeats) releases its loaded models (their queued
operations fail with the reason) and its ephemeral sampler snapshots; records and checkpoints stay.
The plain methods read or write the store and block (the routes call them in a thread).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import uuid

from skylift.tinker.checkpoints.operations import CheckpointOperations
from skylift.tinker.core.requests import Requests
from skylift.tinker.sampling.snapshots import SnapshotStore
from skylift.tinker.sessions.bodies import CreateSessionBody
from skylift.tinker.storage.store import SessionRow, Store, utcnow
from skylift.tinker.training.registry import ModelRegistry

logger = logging.getLogger(__name__)


class SessionOperations:
    """Create, beat, finish and clean up sessions."""

    def __init__(
        self,
        requests: Requests,
        registry: ModelRegistry,
        snapshots: SnapshotStore,
        checkpoints: CheckpointOperations,
    ) -> None:
        self.requests, self.registry = requests, registry
        self.store: Store = registry.store
        self.snapshots, self.checkpoints = snapshots, checkpoints
        self._cleanup_task: asyncio.Task[None] | None = None

    def create_session(self, body: CreateSessionBody, owner: str | None = None) -> str:
        session_id = f"s{uuid.uuid4().hex[:16]}"
        sdk_version = body.sdk_version
        self.store.add(
            SessionRow(
                id=session_id,
                tags=list(body.tags),
                user_metadata=body.user_metadata or {},
                sdk_version=sdk_version if sdk_version is None else sdk_version[:64],
            )
        )
        if owner is not None:
            self.store.set_session_owner(session_id, owner)
        return session_id

    def session(self, session_id: str) -> SessionRow:
        """A session's record (blocking)."""
        return self.store.require(SessionRow, session_id, "session")

    def heartbeat(self, session_id: str) -> bool:
        """False when the session is finished (the SDK stops beating on 410)."""
        row = self.session(session_id)
        if row.finished_at is not None:
            return False
        self.store.update(SessionRow, session_id, last_heartbeat=utcnow())
        return True

    async def finish_session(self, session_id: str, reason: str) -> None:
        await self.requests.db(self.session, session_id)
        await self._finish(session_id, reason)

    def _mark_finished(self, session_id: str, reason: str) -> list[str]:
        """Record the session finished (once); its model ids (blocking)."""
        row = self.store.get(SessionRow, session_id)
        if row is not None and row.finished_at is None:
            self.store.update(SessionRow, session_id, finished_at=utcnow(), finish_reason=reason)
        return [m.model_id for m in self.store.models_of_session(session_id)]

    async def _finish(self, session_id: str, reason: str) -> None:
        for model_id in await self.requests.db(self._mark_finished, session_id, reason):
            await self.registry.release_model(
                model_id,
                f"session {session_id} finished ({reason}) before this operation of model "
                f"{model_id} ran; create a new ServiceClient and training client to continue",
            )
        self.snapshots.release_session(session_id)

    # ---------------------------------------------------------------- cleanup
    def start_cleanup(self, interval_s: float, session_timeout_s: float) -> None:
        """Every `interval_s`: `cleanup_stale(session_timeout_s)` (until `stop_cleanup`)."""

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval_s)
                try:
                    await self.cleanup_stale(session_timeout_s)
                except Exception:
                    logger.exception("stale-session cleanup failed")

        self._cleanup_task = asyncio.get_running_loop().create_task(loop())

    def stop_cleanup(self) -> None:
        if self._cleanup_task is not None:
            self._cleanup_task.cancel()

    async def cleanup_stale(self, session_timeout_s: float) -> list[str]:
        """Finish sessions without a heartbeat for `session_timeout_s`, free their models, and
        delete expired checkpoints. Returns the finished session ids."""
        cutoff = utcnow() - dt.timedelta(seconds=session_timeout_s)
        finished = []
        for row in await self.requests.db(self.store.stale_sessions, cutoff):
            logger.info("session %s missed its heartbeats; finishing it", row.id)
            await self._finish(row.id, "stale")
            finished.append(row.id)
        await self.requests.db(self.checkpoints.delete_expired)
        return finished
