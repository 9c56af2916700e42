"""`TinkerService`: the Tinker operations, independent of HTTP.

It owns its collaborators and hands each one what it needs: the store, the futures, the served
base models, one ordered queue and one `TrainedModel` per loaded training model, the training
operations (`TrainingOperations`, handed what they use of all this), the checkpoint writer, the
sampling side (`SamplingService`: engines, snapshots, stability records) and the image render
hosts. Every operation that answers with a future goes through `submit`. Training work runs on
one background thread (torch uses its own intra-op threads). The store is never touched on the
event loop: async code goes through `db` (a worker thread); the plain methods that read or write
it (`session`, `heartbeat`, `create_session`, `training.get_info`, `delete_checkpoint`) block and
are called in a thread. A model's operations keep their order: `submit_model_op` puts them on the
model's ordered queue without awaiting anything, and the queue runs them one at a time by seq id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import gc
import logging
import secrets
import shutil
import uuid
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NoReturn, TypeVar

from skylift.config.services import ServerConfig
from skylift.tinker.checkpoints.writer import CheckpointWriter
from skylift.tinker.core import durable
from skylift.tinker.core.auth import current_user
from skylift.tinker.core.base_models import BaseModelInfo, BaseModels
from skylift.tinker.core.errors import UserError
from skylift.tinker.core.fairness import FairGate
from skylift.tinker.core.futures import FutureHub, OrderedQueue, Work
from skylift.tinker.core.limits import RequestLimits
from skylift.tinker.core.provenance import StabilityRecords
from skylift.tinker.sampling.bodies import SampleBody
from skylift.tinker.sampling.service import SamplingService
from skylift.tinker.sampling.snapshots import MIB, SnapshotStore
from skylift.tinker.sessions.bodies import CreateSessionBody
from skylift.tinker.storage.store import CheckpointRow, ModelRow, SessionRow, Store, utcnow
from skylift.tinker.storage.views import KIND_SEGMENT
from skylift.tinker.training.admission import Admission
from skylift.tinker.training.base_pool import BasePool
from skylift.tinker.training.operations import TrainingOperations
from skylift.tinker.training.trained_model import ModelConfig, TrainedModel
from skylift.tinker.vision.host import RenderHosts
from skylift.utils.affinity import bind_this_process, bind_this_thread

logger = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["BaseModelInfo", "ServerConfig", "TinkerService"]


#: prepare(request id) -> the work of a new request (it may raise: the request then fails with it)
Prepare = Callable[[str], Awaitable[Work]]


def confine_thread(cpus: list[int]) -> None:
    """Bind the calling thread to `cpus` and size torch's intra-op threads to them."""
    import torch

    bind_this_thread(cpus)
    torch.set_num_threads(len(cpus))


class TinkerService:
    """All Tinker operations; `start()` inside the serving event loop, `stop()` at shutdown."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.store = Store(config.db_url)
        self.data_dir = Path(config.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.base_models = BaseModels(config.base_models, config.max_model_len)
        self.models: dict[str, TrainedModel] = {}
        self.queues: dict[str, OrderedQueue] = {}
        self.pool = BasePool()  # one resident base per base model for its LoRA clients
        self.admission = Admission.from_config(config)  # the app hands it the users file's caps
        self.render_hosts = RenderHosts(self.data_dir, {b.path: b.max_model_len for b in self.base_models})
        self.snapshots = SnapshotStore(
            int(config.snapshot_memory_mb * MIB),
            config.max_idle_snapshots,
            int(config.max_snapshot_mb_per_user * MIB),
        )
        self.records = StabilityRecords(max_tokens_per_user=config.max_record_tokens_per_user)
        self.sampling = SamplingService(
            self.store,
            self.base_models,
            dataclasses.replace(  # the engines share what the training budget leaves of the GPU
                config.engine,
                gpu_memory_utilization=self.admission.sampler_memory_utilization(len(config.base_models)),
            ),
            self.snapshots,
            self.records,
            self.render_hosts,
            self.spawn,
            media_roots=RequestLimits.from_config(config).media_roots,
            gate=(config.sampling_slots, config.fair_wait_timeout_s),
            confine_server=self.confine_server,
        )
        self.url_secret = secrets.token_bytes(32)  # signs download URLs (valid while this process runs)
        self._hub: FutureHub | None = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinker-train")
        self.train_gate = FairGate(
            1, config.fair_wait_timeout_s, "the training thread", "--fair-wait-timeout-s"
        )
        self._cleanup_task: asyncio.Task[None] | None = None
        self._background: set[asyncio.Task[Any]] = set()
        self.checkpoint_writer = CheckpointWriter(
            store=self.store,
            db=self.db,
            run_training=self.run_training,
            run_dir=self.run_dir,
            gb_per_user=config.max_checkpoint_gb_per_user,
        )
        self.training = TrainingOperations(
            store=self.store,
            base_models=self.base_models,
            models=self.models,
            admission=self.admission,
            records=self.records,
            sampling=self.sampling,
            db=self.db,
            run_training=self.run_training,
            submit=self.submit,
            submit_model_op=self.submit_model_op,
            render_images=self.render_images,
            new_model=self.new_model,
            setup_work=self.setup_work,
            write_checkpoint=self.checkpoint_writer.write,
        )

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self._hub = FutureHub(
            self.store,
            self.config.result_retention_s,
            self.config.future_max_age_s,
            self.config.max_pending_per_user,
        )
        lost = await asyncio.to_thread(self.store.mark_pending_lost)  # retrieve_future answers 410
        await asyncio.to_thread(self.store.mark_loaded_models_unloaded)
        await asyncio.to_thread(self._sweep_unrecorded_versions)
        if lost:
            logger.warning(
                "%d requests were pending when the server last stopped; clients resubmit them", lost
            )
        self._cleanup_task = asyncio.get_running_loop().create_task(self._cleanup_loop())
        gc.freeze()  # the modules and objects of start-up: out of the collector's full passes

    def _sweep_unrecorded_versions(self) -> None:
        """Delete checkpoint versions a crash left behind: directories with a version tag
        (`skylift.tinker.core.durable`) that no record names (a write that never got recorded, or an
        overwritten version whose deletion did not happen)."""
        recorded = {str(Path(c.directory)) for c in self.store.checkpoints()}
        for directory in self.data_dir.glob(f"runs/*/*/*{durable.VERSION_SEP}*"):
            if directory.is_dir() and str(directory) not in recorded:
                logger.info("deleting %s: an unrecorded checkpoint version", directory)
                shutil.rmtree(directory, ignore_errors=True)

    async def stop(self) -> None:
        if self._cleanup_task is not None:
            self._cleanup_task.cancel()
        for queue in self.queues.values():
            await queue.close()
        if self._hub is not None:
            await self._hub.close()
        for task in list(self._background):
            task.cancel()
        await self.sampling.close()
        await asyncio.to_thread(self.render_hosts.close_all)
        self._executor.shutdown(wait=False, cancel_futures=True)
        await self.db(self.store.close)

    async def db(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` (a store call, or a function made of them) on a worker thread."""
        return await asyncio.to_thread(fn, *args, **kwargs)

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.cleanup_interval_s)
            try:
                await self.cleanup_stale()
            except Exception:
                logger.exception("stale-session cleanup failed")

    async def cleanup_stale(self) -> list[str]:
        """Finish sessions without a heartbeat for `session_timeout_s`, free their models, and
        delete expired checkpoints. Returns the finished session ids."""
        cutoff = utcnow() - dt.timedelta(seconds=self.config.session_timeout_s)
        finished = []
        for row in await self.db(self.store.stale_sessions, cutoff):
            logger.info("session %s missed its heartbeats; finishing it", row.id)
            await self._finish(row.id, "stale")
            finished.append(row.id)
        await self.db(self._delete_expired_checkpoints)
        return finished

    def _delete_expired_checkpoints(self) -> None:
        now = utcnow()
        for ckpt in self.store.checkpoints():
            if ckpt.expires_at is not None and ckpt.expires_at < now:
                self.delete_checkpoint(ckpt.tinker_path)

    # ---------------------------------------------------------------- the one submit path
    @property
    def hub(self) -> FutureHub:
        if self._hub is None:
            raise RuntimeError("service not started")
        return self._hub

    async def submit(
        self,
        kind: str,
        model_id: str | None,
        dedup_keys: Sequence[str | None],
        prepare: Prepare,
        queue_seq: int | None | bool = False,
    ) -> str:
        """Record a request and run it; returns its request id (a repeated POST gets the first id).

        `prepare(request_id)` runs now (it may register a model, validate, ...) and returns the work; an error
        it raises fails the request. With `queue_seq` an int or None the work runs on the model's
        ordered queue at that seq id; with False it runs at once in the background. A `prepare`
        that awaits nothing keeps the request's place: it is queued before this call returns
        control to the loop.
        """
        hub = self.hub
        request_id, new = hub.submit(kind, model_id, dedup_keys)
        if not new:
            return request_id
        try:
            work = await prepare(request_id)
        except Exception as exc:
            hub.fail(request_id, exc)
            await hub.persisted(request_id)
            return request_id
        if queue_seq is False:
            hub.start(request_id, work)
        else:
            queue = self.queues.get(str(model_id))
            if queue is None:
                hub.fail(request_id, RuntimeError(f"model {model_id} has no queue"))
            else:
                seq = None if queue_seq is None or queue_seq is True else int(queue_seq)
                self.spawn(queue.put(seq, lambda: hub.execute(request_id, work)))
        await hub.persisted(request_id)  # the reply names it: its record must survive a crash
        return request_id

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

        async def prepare(request_id: str) -> Work:
            model = self.models.get(model_id)
            if model is None or model_id not in self.queues:
                await self.db(self._refuse_unloaded, model_id)
            self.touch_model(model_id)
            return lambda: fn(model)

        queued = seq_id if model_id in self.queues else False
        return await self.submit(kind, model_id, keys, prepare, queue_seq=queued)

    def _refuse_unloaded(self, model_id: str) -> NoReturn:
        """Raise why `model_id` takes no operation (blocking: it reads the model's record)."""
        row = self.store.require(ModelRow, model_id, "model id")
        raise UserError(
            f"model {model_id} is not loaded (status {row.status}: its session ended or the server "
            "restarted); create a training client from one of its checkpoints"
        )

    def confine_server(self, cpus: list[int]) -> None:
        """Keep this process (the training thread, the HTTP loop, the database writer, and the
        engine's scheduler process started next) on `cpus`, torch's threads sized to them from the
        next operation on: `SamplingService` calls this before an engine takes the other cores."""
        bind_this_process(cpus)
        self._executor.submit(confine_thread, cpus)

    async def run_training(self, fn: Any, *args: Any) -> Any:
        """`fn(*args)` on the one training thread, when the calling user's turn comes (round robin
        between users, `skylift.tinker.core.fairness`)."""
        async with self.train_gate.slot(current_user.get()):
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def spawn(self, coro: Awaitable[Any]) -> None:
        """Run `coro` in the background (cancelled at `stop`)."""
        task = asyncio.get_running_loop().create_task(coro)  # type: ignore[arg-type]
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---------------------------------------------------------------- files and records
    def run_dir(self, model_id: str, kind: str, name: str) -> Path:
        return self.data_dir / "runs" / model_id / KIND_SEGMENT[kind] / name

    def delete_checkpoint(self, path: str) -> CheckpointRow | None:
        """Delete a checkpoint's record and files; None when it does not exist."""
        row = self.store.delete_checkpoint(path)
        if row is not None:
            shutil.rmtree(row.directory, ignore_errors=True)
        return row

    async def render_images(self, model_path: str, data: list[Any]) -> None:
        """Render the image-bearing datums of a batch (text-only batches never get here)."""
        await self.render_hosts.get(model_path).render_datums(data)

    def _release_render_server(self, model_path: str) -> None:
        """Stop a base model's CPU render server once no loaded model of that base is left."""
        host = self.render_hosts.hosts.get(model_path)
        if host is None or any(m.config.model_path == model_path for m in self.models.values()):
            return
        self.spawn(asyncio.to_thread(host.close))

    def touch_model(self, model_id: str) -> None:
        """Record a model's last request time (in the background)."""

        async def touch() -> None:
            try:
                await self.db(self.store.update, ModelRow, model_id, last_request_time=utcnow())
            except Exception as exc:
                logger.warning("recording the last request time of %s failed: %s", model_id, exc)

        self.spawn(touch())

    # ---------------------------------------------------------------- sessions
    def create_session(self, body: CreateSessionBody) -> str:
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
        await self.db(self.session, session_id)
        await self._finish(session_id, reason)

    def _mark_finished(self, session_id: str, reason: str) -> list[str]:
        """Record the session finished (once); its model ids (blocking)."""
        row = self.store.get(SessionRow, session_id)
        if row is not None and row.finished_at is None:
            self.store.update(SessionRow, session_id, finished_at=utcnow(), finish_reason=reason)
        return [m.model_id for m in self.store.models_of_session(session_id)]

    async def _finish(self, session_id: str, reason: str) -> None:
        for model_id in await self.db(self._mark_finished, session_id, reason):
            await self.release_model(
                model_id,
                f"session {session_id} finished ({reason}) before this operation of model "
                f"{model_id} ran; create a new ServiceClient and training client to continue",
            )
        self.snapshots.release_session(session_id)

    async def release_model(self, model_id: str, reason: str | None = None) -> None:
        """Free a model's memory; its records and checkpoints stay. Its queued and running
        operations fail at once with `reason` (a user error)."""
        model = self.models.pop(model_id, None)
        queue = self.queues.pop(model_id, None)
        self.admission.release(model_id)
        if self._hub is not None and (model is not None or queue is not None):
            self._hub.abandon_model(
                model_id, reason or f"model {model_id} was released before this operation ran"
            )
        if queue is not None:
            self.spawn(queue.close())
        if model is not None:
            model.close()
            self._release_render_server(model.config.model_path)
            await self.db(self._mark_unloaded, model_id)

    def _mark_unloaded(self, model_id: str) -> None:
        row = self.store.get(ModelRow, model_id)
        if row is not None and row.status == "ready":
            self.store.update(ModelRow, model_id, status="unloaded")

    # ---------------------------------------------------------------- models
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
            await self.db(self._add_model, session_id, row)
        except Exception:
            self.admission.release(model_id)
            raise
        model = TrainedModel(model_id, config, self.config.micro_batch_size, self.pool)
        self.models[model_id] = model
        self.queues[model_id] = OrderedQueue(model_id, self.config.gap_timeout_s)
        return model_id, model

    def _add_model(self, session_id: str, row: ModelRow) -> None:
        session = self.session(session_id)
        if session.finished_at is not None:
            raise UserError(f"session {session_id} is finished; create a new ServiceClient")
        self.store.add(row)

    def setup_work(self, model: TrainedModel, load: tuple[Path, bool] | None, result: dict[str, Any]) -> Work:
        """The work that builds a new model (and loads a checkpoint into it)."""

        async def work() -> dict[str, Any]:
            try:
                await self.run_training(model.setup)
                if load is not None:
                    await self.run_training(model.load_state, *load)
            except Exception:
                await self.db(self.store.update, ModelRow, model.model_id, status="failed")
                await self.release_model(model.model_id)
                raise
            await self.db(self.store.update, ModelRow, model.model_id, status="ready")
            return result

        return work

    # ---------------------------------------------------------------- sampling
    async def asample(self, body: SampleBody, idem: str | None) -> tuple[str, list[str]]:
        """(request id, sequence ids) of a sample request."""
        num = self.sampling.check_request(body)
        sampling_id, seq = body.sampling_session_id, body.seq_id
        keys = [
            f"sample:{sampling_id}:{seq}" if sampling_id and seq is not None else None,
            f"idem:{idem}" if idem else None,
        ]

        async def prepare(request_id: str) -> Work:
            return lambda: self.sampling.sample(body, request_id)

        request_id = await self.submit("sample", None, keys, prepare)
        return request_id, [f"{request_id}:{i}" for i in range(num)]
