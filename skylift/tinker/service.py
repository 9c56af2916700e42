"""`TinkerService`: the Tinker service's parts, built and wired; nothing else.

Each feature is an object handed the collaborators it uses, and each router reaches its own
feature (the app's state holds them by name, `skylift.tinker.core.deps.app_part`):

- `requests` (`core.requests.Requests`): the futures, the models' ordered queues, the one
  training thread; every operation that answers with a future is submitted through it;
- `registry` (`training.registry.ModelRegistry`): the loaded training models;
- `training` (`training.operations.TrainingOperations`): create, forward/backward, optim, save, load;
- `sampling` (`sampling.service.SamplingService`): sampling sessions, samples, the engines;
- `checkpoints` (`checkpoints.operations.CheckpointOperations`): exports, publishing, TTLs, copies;
- `sessions` (`sessions.operations.SessionOperations`) and `runs` (`sessions.runs.RunViews`):
  sessions' lifecycle and cleanup; the REST views of sessions, runs and checkpoints;
- `stats` (`sessions.stats.ServerStats`): the sharing figures and skylift's status.

The store is never touched on the event loop (`requests.db` runs a store call on a worker thread).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import shutil
from functools import partial
from pathlib import Path

from skylift.config.services import ServerConfig
from skylift.tinker.checkpoints.operations import CheckpointOperations
from skylift.tinker.checkpoints.writer import CheckpointWriter
from skylift.tinker.core import durable
from skylift.tinker.core.base_models import BaseModelInfo, BaseModels
from skylift.tinker.core.limits import RequestLimits
from skylift.tinker.core.provenance import StabilityRecords
from skylift.tinker.core.requests import Requests
from skylift.tinker.sampling.service import SamplingService
from skylift.tinker.sampling.snapshots import MIB, SnapshotStore
from skylift.tinker.sessions.operations import SessionOperations
from skylift.tinker.sessions.runs import RunViews
from skylift.tinker.sessions.stats import ServerStats
from skylift.tinker.storage.store import Store
from skylift.tinker.storage.views import run_dir
from skylift.tinker.training.admission import Admission
from skylift.tinker.training.operations import TrainingOperations
from skylift.tinker.training.registry import ModelRegistry
from skylift.tinker.vision.host import RenderHosts

logger = logging.getLogger(__name__)

__all__ = ["BaseModelInfo", "ServerConfig", "TinkerService"]


class TinkerService:
    """The Tinker service's parts; `start()` inside the serving event loop, `stop()` at shutdown."""

    def __init__(self, config: ServerConfig) -> None:
        self.config = c = config
        self.store = Store(c.db_url)
        self.data_dir = Path(c.data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.base_models = BaseModels(c.base_models, c.max_model_len)
        self.requests = Requests(self.store, c)
        self.admission = Admission.from_config(c)  # the app hands it the users file's caps
        self.render_hosts = RenderHosts(self.data_dir, {b.path: b.max_model_len for b in self.base_models})
        self.registry = ModelRegistry(
            self.requests, self.store, self.admission, self.render_hosts, c.micro_batch_size, c.gap_timeout_s
        )
        self.snapshots = SnapshotStore(
            int(c.snapshot_memory_mb * MIB), c.max_idle_snapshots, int(c.max_snapshot_mb_per_user * MIB)
        )
        self.records = StabilityRecords(max_tokens_per_user=c.max_record_tokens_per_user)
        self.sampling = SamplingService(
            self.store,
            self.base_models,
            dataclasses.replace(  # the engines share what the training budget leaves of the GPU
                c.engine, gpu_memory_utilization=self.admission.sampler_memory_utilization(len(c.base_models))
            ),
            self.snapshots,
            self.records,
            self.render_hosts,
            self.requests,
            media_roots=RequestLimits.from_config(c).media_roots,
            gate=(c.sampling_slots, c.fair_wait_timeout_s),
        )
        writer = CheckpointWriter(
            store=self.store,
            db=self.requests.db,
            run_training=self.requests.run_training,
            run_dir=partial(run_dir, self.data_dir),
            gb_per_user=c.max_checkpoint_gb_per_user,
        )
        self.checkpoints = CheckpointOperations(
            self.store, self.registry, writer, c.max_checkpoint_gb_per_user
        )
        self.training = TrainingOperations(
            requests=self.requests,
            registry=self.registry,
            base_models=self.base_models,
            records=self.records,
            sampling=self.sampling,
            render_hosts=self.render_hosts,
            write_checkpoint=writer.write,
        )
        self.sessions = SessionOperations(self.requests, self.registry, self.snapshots, self.checkpoints)
        self.runs = RunViews(self.store, self.checkpoints)
        self.stats = ServerStats(self.registry, self.requests.train_gate, self.sampling, self.snapshots)

    async def start(self) -> None:
        await self.requests.start()
        lost = await asyncio.to_thread(self.store.mark_pending_lost)  # retrieve_future answers 410
        await asyncio.to_thread(self.store.mark_loaded_models_unloaded)
        await asyncio.to_thread(self._sweep_unrecorded_versions)
        if lost:
            logger.warning(
                "%d requests were pending when the server last stopped; clients resubmit them", lost
            )
        self.sessions.start_cleanup(self.config.cleanup_interval_s, self.config.session_timeout_s)
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
        self.sessions.stop_cleanup()
        await self.requests.stop()
        await self.sampling.close()
        await asyncio.to_thread(self.render_hosts.close_all)
        await self.requests.db(self.store.close)
