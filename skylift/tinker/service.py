"""`TinkerService`: the Tinker operations, independent of HTTP.

It owns the store, the futures, one ordered queue and one `TrainedModel` per loaded training
model, and the lazily started sampling engines. Training work runs on one background thread
(torch uses its own intra-op threads); the store is only touched from the event loop.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import os
import shutil
import uuid
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from skylift.config.services import ServerConfig
from skylift.tinker.backend import ModelConfig, TrainedModel
from skylift.tinker.errors import NotFoundError, UserError
from skylift.tinker.futures import FutureHub, OrderedQueue
from skylift.tinker.render_host import RenderHost
from skylift.tinker.sampling import EngineHost
from skylift.tinker.store import CheckpointRow, ModelRow, SessionRow, Store, utcnow

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass
class BaseModelInfo:
    name: str
    path: str
    max_model_len: int
    arch: str | None


class TinkerService:
    """All Tinker operations; `start()` inside the serving event loop, `stop()` at shutdown."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = Store(config.db_url)
        self.data_dir = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.base_models = [self._describe_base_model(name) for name in config.base_models]
        if not self.base_models:
            raise ValueError("at least one --base-model is required")
        self.models: dict[str, TrainedModel] = {}
        self.queues: dict[str, OrderedQueue] = {}
        self.engines: dict[str, EngineHost] = {}
        self.render_hosts: dict[str, RenderHost] = {}  # by base model path: image rendering
        self.snapshots: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self.hub: FutureHub | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        self._cleanup_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        from skylift.tinker.sampler_service import SamplingService

        self.sampling = SamplingService(self)

    # ---------------------------------------------------------------- lifecycle
    def _describe_base_model(self, name: str) -> BaseModelInfo:
        from transformers import AutoConfig

        from skylift.models import resolve_model_path

        path = os.path.realpath(resolve_model_path(name))
        cfg = AutoConfig.from_pretrained(path)
        positions = getattr(cfg.get_text_config(), "max_position_embeddings", None) or 2048
        limit = self.config.max_model_len or min(int(positions), 4096)
        arch = (getattr(cfg, "architectures", None) or [None])[0]
        return BaseModelInfo(name=name, path=path, max_model_len=limit, arch=arch)

    async def start(self) -> None:
        self.hub = FutureHub(self.store, self.config.result_retention_s)
        lost = await asyncio.to_thread(self.store.mark_pending_lost)  # retrieve_future answers 410
        await asyncio.to_thread(self.store.mark_loaded_models_unloaded)
        if lost:
            logger.warning(
                "%d requests were pending when the server last stopped; clients resubmit them", lost
            )
        self._cleanup_task = asyncio.get_running_loop().create_task(self._cleanup_loop())

    async def stop(self) -> None:
        if self._cleanup_task is not None:
            self._cleanup_task.cancel()
        for queue in self.queues.values():
            await queue.close()
        if self.hub is not None:
            await self.hub.close()
        for task in list(self._background):
            task.cancel()
        for host in self.engines.values():
            await asyncio.to_thread(host.close)
        for render in self.render_hosts.values():
            await asyncio.to_thread(render.close)
        self._executor.shutdown(wait=False, cancel_futures=True)
        self.store.close()

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.cleanup_interval_s)
            try:
                self.cleanup_stale()
            except Exception:
                logger.exception("stale-session cleanup failed")

    def cleanup_stale(self) -> list[str]:
        """Finish sessions without a heartbeat for `session_timeout_s`, free their models, and
        delete expired checkpoints. Returns the finished session ids."""
        cutoff = utcnow() - dt.timedelta(seconds=self.config.session_timeout_s)
        finished = []
        for row in self.store.stale_sessions(cutoff):
            logger.info("session %s missed its heartbeats; finishing it", row.id)
            self._finish(row.id, "stale")
            finished.append(row.id)
        now = utcnow()
        for ckpt in self.store.checkpoints():
            if ckpt.expires_at is not None and ckpt.expires_at < now:
                self._delete_checkpoint_files(ckpt.tinker_path)
        return finished

    # ---------------------------------------------------------------- helpers
    def _hub(self) -> FutureHub:
        if self.hub is None:
            raise RuntimeError("service not started")
        return self.hub

    def base_model(self, name: str | None) -> BaseModelInfo:
        """The served base model `name` refers to (by name or by path)."""
        if not name:
            raise UserError("base_model is required")
        for info in self.base_models:
            if name == info.name:
                return info
        real = os.path.realpath(name) if os.path.exists(name) else None
        for info in self.base_models:
            if real == info.path:
                return info
        raise UserError(
            f"base model {name!r} is not served here; served: {[b.name for b in self.base_models]}"
        )

    async def run_training(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    def run_dir(self, model_id: str, kind: str, name: str) -> Path:
        segment = "weights" if kind == "training" else "sampler_weights"
        return self.data_dir / "runs" / model_id / segment / name

    @staticmethod
    def store_path(row: CheckpointRow) -> Path:
        return Path(row.directory)

    def _delete_checkpoint_files(self, path: str) -> CheckpointRow | None:
        row = self.store.delete_checkpoint(path)
        if row is not None:
            shutil.rmtree(row.directory, ignore_errors=True)
        return row

    # ---------------------------------------------------------------- images
    def render_host(self, model_path: str) -> RenderHost:
        """The image renderer of a base model (created on first use; starts nothing)."""
        host = self.render_hosts.get(model_path)
        if host is None:
            info = next((b for b in self.base_models if b.path == model_path), None)
            host = RenderHost(
                model_path,
                max_model_len=info.max_model_len if info else None,
                log_path=self.data_dir / f"render-server-{len(self.render_hosts)}.log",
            )
            self.render_hosts[model_path] = host
        return host

    async def render_images(self, model_path: str, data: list[Any]) -> None:
        """Render the image-bearing datums of a batch (text-only batches never get here)."""
        await self.render_host(model_path).render_datums(data)

    def _release_render_server(self, model_path: str) -> None:
        """Stop a base model's CPU render server once no loaded model of that base is left."""
        host = self.render_hosts.get(model_path)
        if host is None or any(m.config.model_path == model_path for m in self.models.values()):
            return
        self._spawn(asyncio.to_thread(host.close))

    def touch_model(self, model_id: str) -> None:
        self.store.update(ModelRow, model_id, last_request_time=utcnow())

    # ---------------------------------------------------------------- sessions
    def create_session(self, body: dict[str, Any]) -> str:
        tags, metadata = body.get("tags") or [], body.get("user_metadata") or {}
        if not isinstance(tags, list) or not isinstance(metadata, dict):
            raise UserError("create_session: tags must be a list and user_metadata an object")
        session_id = f"s{uuid.uuid4().hex[:16]}"
        self.store.add(
            SessionRow(
                id=session_id,
                tags=tags,
                user_metadata=metadata,
                sdk_version=body.get("sdk_version"),
            )
        )
        return session_id

    def session(self, session_id: str) -> SessionRow:
        row = self.store.get(SessionRow, session_id)
        if row is None:
            raise NotFoundError(f"unknown session {session_id!r}")
        return row

    def heartbeat(self, session_id: str) -> bool:
        """False when the session is finished (the SDK stops beating on 410)."""
        row = self.session(session_id)
        if row.finished_at is not None:
            return False
        self.store.update(SessionRow, session_id, last_heartbeat=utcnow())
        return True

    def finish_session(self, session_id: str, reason: str) -> None:
        self.session(session_id)
        self._finish(session_id, reason)

    def _finish(self, session_id: str, reason: str) -> None:
        row = self.store.get(SessionRow, session_id)
        if row is not None and row.finished_at is None:
            self.store.update(SessionRow, session_id, finished_at=utcnow(), finish_reason=reason)
        for model in self.store.models_of_session(session_id):
            self.release_model(
                model.model_id,
                f"session {session_id} finished ({reason}) before this operation of model "
                f"{model.model_id} ran; create a new ServiceClient and training client to continue",
            )

    def release_model(self, model_id: str, reason: str | None = None) -> None:
        """Free a model's memory; its records and checkpoints stay. Its queued and running
        operations fail at once with `reason` (a user error)."""
        model = self.models.pop(model_id, None)
        queue = self.queues.pop(model_id, None)
        if self.hub is not None and (model is not None or queue is not None):
            self.hub.abandon_model(
                model_id, reason or f"model {model_id} was released before this operation ran"
            )
        if queue is not None:
            self._spawn(queue.close())
        if model is not None:
            model.close()
            self._release_render_server(model.config.model_path)
            row = self.store.get(ModelRow, model_id)
            if row is not None and row.status == "ready":
                self.store.update(ModelRow, model_id, status="unloaded")

    # ---------------------------------------------------------------- models
    def _new_model(
        self, session_id: str, model_seq_id: int, config: ModelConfig, user_metadata: Any
    ) -> tuple[str, TrainedModel | None]:
        """Register model `<session>:train:<seq>`; None when it already exists (a repeated POST)."""
        session = self.session(session_id)
        if session.finished_at is not None:
            raise UserError(f"session {session_id} is finished; create a new ServiceClient")
        model_id = f"{session_id}:train:{int(model_seq_id)}"
        if self.store.get(ModelRow, model_id) is not None:
            return model_id, None
        self.store.add(
            ModelRow(
                model_id=model_id,
                session_id=session_id,
                base_model=config.base_model,
                config=config.to_json(),
                user_metadata=user_metadata,
            )
        )
        model = TrainedModel(model_id, config, micro_batch_size=self.config.micro_batch_size)
        self.models[model_id] = model
        self.queues[model_id] = OrderedQueue(model_id, self.config.gap_timeout_s)
        return model_id, model

    def create_model(self, body: dict[str, Any]) -> tuple[str, str]:
        """(request id, model id); the future resolves when the model is built."""
        hub = self._hub()
        session_id, seq = str(body.get("session_id")), int(body.get("model_seq_id", 0))
        model_id = f"{session_id}:train:{seq}"
        request_id, new = hub.submit("create_model", model_id, [f"create:{model_id}"])
        if not new:
            return request_id, model_id
        try:
            info = self.base_model(body.get("base_model"))
            lora, optimizer_config = body.get("lora_config") or {}, body.get("optimizer_config") or {}
            if not isinstance(lora, dict) or not isinstance(optimizer_config, dict):
                raise UserError("create_model: lora_config and optimizer_config must be objects")
            optimizer = optimizer_config.get("type", "adamw")
            if optimizer != "adamw":
                raise UserError(f"optimizer {optimizer!r} is not supported; this server trains with adamw")
            config = ModelConfig(
                base_model=str(body["base_model"]),
                model_path=info.path,
                lora_rank=int(lora.get("rank", 0)),
                train_attn=bool(lora.get("train_attn", True)),
                train_mlp=bool(lora.get("train_mlp", True)),
                train_unembed=bool(lora.get("train_unembed", True)),
                seed=int(lora.get("seed") or 0),
            )
            if config.is_lora:
                config.target_modules()  # validates the choice early
            _, model = self._new_model(session_id, seq, config, body.get("user_metadata"))
        except (TypeError, ValueError, AttributeError) as exc:  # e.g. a lora_config of the wrong shape
            if not isinstance(exc, UserError):
                exc = UserError(f"create_model: malformed request ({type(exc).__name__}: {exc})")
            hub.fail(request_id, exc)
            return request_id, model_id
        except Exception as exc:
            hub.fail(request_id, exc)
            return request_id, model_id
        assert model is not None
        result = {"model_id": model_id, "type": "create_model"}
        self._enqueue_setup(request_id, model, None, result)
        return request_id, model_id

    def _enqueue_setup(
        self, request_id: str, model: TrainedModel, load: tuple[Path, bool] | None, result: dict[str, Any]
    ) -> None:
        async def work() -> dict[str, Any]:
            try:
                await self.run_training(model.setup)
                if load is not None:
                    await self.run_training(model.load_state, *load)
            except Exception:
                self.store.update(ModelRow, model.model_id, status="failed")
                self.release_model(model.model_id)
                raise
            self.store.update(ModelRow, model.model_id, status="ready")
            return result

        queue = self.queues[model.model_id]
        self._spawn(queue.put(0, lambda: self._hub().execute(request_id, work)))

    def get_info(self, model_id: str) -> dict[str, Any]:
        row = self.store.get(ModelRow, model_id)
        if row is None:
            raise NotFoundError(f"unknown model id {model_id!r}")
        config = ModelConfig.from_json(row.config)
        info = next((b for b in self.base_models if b.path == os.path.realpath(config.model_path)), None)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {
                "arch": info.arch if info else None,
                "model_name": row.base_model,
                "tokenizer_id": config.model_path,
            },
            "is_lora": config.is_lora,
            "lora_rank": config.lora_rank if config.is_lora else None,
            "model_name": row.base_model,
        }

    def submit_model_op(self, kind: str, model_id: str, seq_id: int | None, fn: Any, idem: str | None) -> str:
        """Queue `fn(model) -> awaitable result` on the model's ordered queue; returns the request id."""
        if seq_id is not None and (not isinstance(seq_id, int) or isinstance(seq_id, bool)):
            raise UserError(f"{kind}: seq_id must be an integer, got {seq_id!r}")
        hub = self._hub()
        keys = [f"op:{model_id}:{seq_id}" if seq_id is not None else None, f"idem:{idem}" if idem else None]
        request_id, new = hub.submit(kind, model_id, keys)
        if not new:
            return request_id
        model, queue = self.models.get(model_id), self.queues.get(model_id)
        if model is None or queue is None:
            row = self.store.get(ModelRow, model_id)
            if row is None:
                error: Exception = NotFoundError(f"unknown model id {model_id!r}")
            else:
                error = UserError(
                    f"model {model_id} is not loaded (status {row.status}: its session ended or the server "
                    "restarted); create a training client from one of its checkpoints"
                )
            hub.fail(request_id, error)
            return request_id
        self.touch_model(model_id)

        async def work() -> Any:
            return await fn(model)

        self._spawn(queue.put(seq_id, lambda: hub.execute(request_id, work)))
        return request_id
