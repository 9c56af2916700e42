"""`ModelRegistry`: the loaded training models, each with its ordered queue.

A model is registered (`new_model`: its memory admitted, its record written, its queue made), built
on the training thread (`setup_work`), given operations in seq order (`submit_model_op`) and
released (`release_model`: its memory freed, its queued operations failed, its record marked
unloaded; its checkpoints stay).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, NoReturn

from skylift.tinker.core.futures import OrderedQueue, Work
from skylift.tinker.core.requests import Requests
from skylift.tinker.errors import UserError
from skylift.tinker.storage.store import ModelRow, SessionRow, Store, utcnow
from skylift.tinker.training.admission import Admission
from skylift.tinker.training.base_pool import BasePool
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel
from skylift.tinker.vision.host import RenderHosts

logger = logging.getLogger(__name__)


class ModelRegistry:
    """The loaded training models (`models`) and their lifecycle."""

    def __init__(
        self,
        requests: Requests,
        store: Store,
        admission: Admission,
        render_hosts: RenderHosts,
        micro_batch_size: int,
        gap_timeout_s: float,
    ) -> None:
        self.requests, self.store = requests, store
        self.admission, self.render_hosts = admission, render_hosts
        self.micro_batch_size, self.gap_timeout_s = micro_batch_size, gap_timeout_s
        self.pool = BasePool()  # one resident base per base model for its LoRA clients
        self.models: dict[str, TrainedModel] = {}

    # ---------------------------------------------------------------- registering and building
    async def new_model(
        self, session_id: str, model_seq_id: int, config: ModelConfig, user_metadata: Any
    ) -> tuple[str, TrainedModel]:
        """Register model `<session>:train:<seq>` with its queue (not built yet: see `setup_work`)."""
        model_id = f"{session_id}:train:{int(model_seq_id)}"
        row = ModelRow(
            model_id=model_id,
            session_id=session_id,
            base_model=config.base_model,
            config=config.to_json(),
            user_metadata=user_metadata,
        )
        self.admission.admit(model_id, config)  # reserves its memory, for the calling user
        try:
            await self.requests.db(self._add_model, session_id, row)
        except Exception:
            self.admission.release(model_id)
            raise
        model = TrainedModel(model_id, config, self.micro_batch_size, self.pool)
        self.models[model_id] = model
        self.requests.queues[model_id] = OrderedQueue(model_id, self.gap_timeout_s)
        return model_id, model

    def _add_model(self, session_id: str, row: ModelRow) -> None:
        session = self.store.require(SessionRow, session_id, "session")
        if session.finished_at is not None:
            raise UserError(f"session {session_id} is finished; create a new ServiceClient")
        self.store.add(row)

    def setup_work(self, model: TrainedModel, load: tuple[Path, bool] | None, result: dict[str, Any]) -> Work:
        """The work that builds a new model (and loads a checkpoint into it)."""
        run, db = self.requests.run_training, self.requests.db

        async def work() -> dict[str, Any]:
            try:
                await run(model.setup)
                if load is not None:
                    await run(model.load_state, *load)
            except Exception:
                await db(self.store.update, ModelRow, model.model_id, status="failed")
                await self.release_model(model.model_id)
                raise
            await db(self.store.update, ModelRow, model.model_id, status="ready")
            return result

        return work

    # ---------------------------------------------------------------- operations in order
    async def submit_model_op(
        self,
        kind: str,
        model_id: str,
        seq_id: Any,
        fn: Callable[[TrainedModel], Awaitable[Any]],
        idem: str | None,
    ) -> str:
        """Queue `fn(model)` on a loaded model's ordered queue; returns the request id. A loaded
        model's operation is queued without awaiting anything (its order is its seq id's)."""
        if seq_id is not None and (not isinstance(seq_id, int) or isinstance(seq_id, bool)):
            raise UserError(f"{kind}: seq_id must be an integer, got {seq_id!r}")
        keys = [f"op:{model_id}:{seq_id}" if seq_id is not None else None, f"idem:{idem}" if idem else None]
        queues = self.requests.queues

        async def prepare(request_id: str) -> Work:
            model = self.models.get(model_id)
            if model is None or model_id not in queues:
                await self.requests.db(self._refuse_unloaded, model_id)
            self.touch_model(model_id)
            return lambda: fn(model)

        queued = seq_id if model_id in queues else False
        return await self.requests.submit(kind, model_id, keys, prepare, queue_seq=queued)

    def _refuse_unloaded(self, model_id: str) -> NoReturn:
        """Raise why `model_id` takes no operation (blocking: it reads the model's record)."""
        row = self.store.require(ModelRow, model_id, "model id")
        raise UserError(
            f"model {model_id} is not loaded (status {row.status}: its session ended or the server "
            "restarted); create a training client from one of its checkpoints"
        )

    def touch_model(self, model_id: str) -> None:
        """Record a model's last request time (in the background)."""

        async def touch() -> None:
            try:
                await self.requests.db(self.store.update, ModelRow, model_id, last_request_time=utcnow())
            except Exception as exc:
                logger.warning("recording the last request time of %s failed: %s", model_id, exc)

        self.requests.spawn(touch())

    # ---------------------------------------------------------------- releasing
    async def release_model(self, model_id: str, reason: str | None = None) -> None:
        """Free a model's memory; its records and checkpoints stay. Its queued and running
        operations fail at once with `reason` (a user error)."""
        model = self.models.pop(model_id, None)
        queue = self.requests.queues.pop(model_id, None)
        self.admission.release(model_id)
        if self.requests.started and (model is not None or queue is not None):
            self.requests.hub.abandon_model(
                model_id, reason or f"model {model_id} was released before this operation ran"
            )
        if queue is not None:
            self.requests.spawn(queue.close())
        if model is not None:
            model.close()
            self._release_render_server(model.config.model_path)
            await self.requests.db(self._mark_unloaded, model_id)

    def _release_render_server(self, model_path: str) -> None:
        """Stop a base model's CPU render server once no loaded model of that base is left."""
        host = self.render_hosts.hosts.get(model_path)
        if host is None or any(m.config.model_path == model_path for m in self.models.values()):
            return
        self.requests.spawn(asyncio.to_thread(host.close))

    def _mark_unloaded(self, model_id: str) -> None:
        row = self.store.get(ModelRow, model_id)
        if row is not None and row.status == "ready":
            self.store.update(ModelRow, model_id, status="unloaded")
