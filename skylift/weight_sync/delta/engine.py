"""The delta transport's engine half (``weight_sync_backend=delta``): operations ``fetch`` and
``load``, each a `DeltaSyncRequest` (``weight_call("delta", operation, request.to_dict())``).

`fetch` brings the host's store (`weight_sync.delta.apply.DeltaStore`) to a published version,
replaying any it missed; it reads files only and can run while the engine generates. `load` (after
a `fetch` of its own, a no-op when done) has every vLLM worker load the tensors that changed since
the version this engine holds (`weight_sync.delta.receiver`), under the engine's weight lock, then
resets the prefix cache. A ``gs://`` or ``s3://`` sync_dir is read through a mirror beside the
store (`weight_sync.delta.cloud`): `fetch` copies the versions the store needs, applies them from
there and drops their payloads. An engine that holds weights the store cannot account for (another run's,
or ones received over a weight-update group) loads every tensor. Bad requests are
`EngineRequestError`s (a version never published: `EngineNotFoundError`) and change nothing.
"""

from __future__ import annotations

import asyncio
import functools
import time
from pathlib import Path
from typing import Any

from skylift.config.delta_sync import is_cloud_uri
from skylift.utils.engine_errors import EngineNotFoundError, EngineRequestError, EngineStateError
from skylift.weight_sync.delta.apply import DeltaStore
from skylift.weight_sync.delta.cloud import drop_payloads, mirror_chain
from skylift.weight_sync.delta.format import (
    CorruptPayloadError,
    DeltaError,
    DeltaVersionNotFound,
    default_store_dir,
    resolve_base_dir,
)
from skylift.weight_sync.engine_side import EngineHost, EngineSide, Payload, WeightState, decode
from skylift.weight_sync.protocol import RPC_LOAD_DELTA, DeltaSyncRequest

MIRROR = "mirror"  # a cloud sync dir's versions, copied beside the store


class DeltaEngineSide(EngineSide):
    """The delta-sync state of one engine: the (run, version) its weights are."""

    transport = "delta"
    #: payload fields that are paths on the engine's host: a server checks them against the roots
    #: it was started with (``--delta-sync-root``) before the call
    checked_paths = ("sync_dir", "local_checkpoint_dir")  # noqa: RUF012 - a ClassVar of the base

    def __init__(self, host: EngineHost, state: WeightState) -> None:
        super().__init__(host, state)
        self.operations = {"fetch": self._fetch_op, "load": self._load_op}
        self.engine = host
        self.loaded: tuple[str, int] = ("", 0)  # ("", 0): the base checkpoint it started from
        self._group_syncs = 0  # the engine's weight loads over a group at the last delta load

    async def _fetch_op(self, payload: Payload) -> dict[str, Any]:
        return await self.fetch(decode(self.host, "fetch_delta", DeltaSyncRequest, payload))

    async def _load_op(self, payload: Payload) -> dict[str, Any]:
        return await self.load(decode(self.host, "load_delta", DeltaSyncRequest, payload))

    @functools.cached_property
    def base_dir(self) -> Path | None:
        """The local directory of the checkpoint the engine started from (None: not local)."""
        return resolve_base_dir(self.engine.model_path)

    def _store(self, request: DeltaSyncRequest, operation: str) -> DeltaStore:
        """The host's store for `request`, after checking what only this host can check."""
        name = f"{self.engine.name}: {operation}"
        if isinstance(request.version, bool) or not isinstance(request.version, int) or request.version < 1:
            raise EngineRequestError(f"{name}: version must be an integer >= 1, got {request.version!r}")
        if not request.sync_dir:
            raise EngineRequestError(f"{name}: sync_dir is missing")
        if not is_cloud_uri(request.sync_dir) and not Path(request.sync_dir).is_dir():
            raise EngineRequestError(
                f"{name}: sync_dir {request.sync_dir!r} is not a directory on this engine's host"
            )
        directory = request.local_checkpoint_dir or default_store_dir(request.sync_dir)
        return DeltaStore(directory, self.base_dir)

    @staticmethod
    def _readable_dir(request: DeltaSyncRequest, store: DeltaStore) -> str:
        """Where the store reads versions from: the sync dir, or the mirror of a cloud one."""
        return str(store.dir / MIRROR) if is_cloud_uri(request.sync_dir) else request.sync_dir

    @staticmethod
    def _fetch_and_apply(request: DeltaSyncRequest, store: DeltaStore) -> list[int]:
        if not is_cloud_uri(request.sync_dir):
            return store.apply(request.sync_dir, request.version)
        mirror = Path(DeltaEngineSide._readable_dir(request, store))
        state = store.state()
        held = (state.run_id, state.version)
        mirror_chain(request.sync_dir, request.version, mirror, held, request.download_workers)
        applied = store.apply(mirror, request.version)
        drop_payloads(mirror, applied)
        return applied

    async def fetch(self, request: DeltaSyncRequest) -> dict[str, Any]:
        """Bring the store to `request.version`; returns {"version", "applied_versions", "seconds"}."""
        store = self._store(request, "fetch_delta")
        start = time.perf_counter()
        name = f"{self.engine.name}: fetch_delta {request.version}"
        try:
            applied = await asyncio.to_thread(self._fetch_and_apply, request, store)
        except DeltaVersionNotFound as exc:
            raise EngineNotFoundError(f"{name}: {exc}") from exc
        except CorruptPayloadError as exc:
            raise EngineRequestError(f"{name}: {exc}") from exc
        except (DeltaError, OSError, ValueError) as exc:
            raise EngineStateError(f"{name}: {exc}") from exc
        return {
            "version": request.version,
            "applied_versions": applied,
            "seconds": time.perf_counter() - start,
        }

    def _names(self, store: DeltaStore, sync_dir: str, run_id: str) -> list[str]:
        """The tensors to load: those changed since the weights this engine holds, or all."""
        if self.state.version != self._group_syncs:  # weights came over a group since
            return store.all_names()
        run, version = self.loaded
        if (run, version) == ("", 0):
            run = run_id  # the base checkpoint: version 0 of every run
        names = store.changed_since(sync_dir, run, version) if run == run_id else None
        return store.all_names() if names is None else names

    async def load(self, request: DeltaSyncRequest) -> dict[str, Any]:
        """Fetch `request.version` (if not yet), load what changed into every worker, reset the
        prefix cache. Returns {"version", "tensors", "bytes", "seconds", "prefix_cache_reset"}."""
        engine = self.engine
        async with self.state.lock:
            fetched = await self.fetch(request)
            store = self._store(request, "load_delta")
            start = time.perf_counter()
            try:
                state = await asyncio.to_thread(store.state)
                if state.version != request.version:
                    raise DeltaError(f"the store {store.dir} moved on to version {state.version}")
                names = await asyncio.to_thread(
                    self._names, store, self._readable_dir(request, store), state.run_id
                )
            except (DeltaError, OSError) as exc:
                raise EngineStateError(f"{engine.name}: load_delta {request.version}: {exc}") from exc
            base = self.base_dir
            args = (str(store.dir), str(base) if base else None, names, state.run_id, state.version)
            results = await engine.rpc(
                f"load_delta {request.version} ({len(names)} tensors)",
                RPC_LOAD_DELTA,
                args,
                engine.update_timeout_s,
            )
            self.loaded, self._group_syncs = (state.run_id, state.version), self.state.version
            reset = await engine.try_reset_prefix_cache()
        return {
            "version": request.version,
            "applied_versions": fetched["applied_versions"],
            "tensors": int(results[0]["tensors"]),
            "bytes": int(results[0]["bytes"]),
            "seconds": time.perf_counter() - start,
            "prefix_cache_reset": reset,
        }
