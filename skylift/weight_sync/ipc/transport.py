"""`SharedTensorsTransport`: full weights this process holds -> engines on its host, by handle.

The same-host counterpart of `broadcast.tensors.TensorsTransport` (same `put` / `push` use): no
weight-update group and no copy through a socket. `push` packs the tensors into shared buffers
(`ipc.handles.share_tensors`: CUDA IPC handles on a GPU, /dev/shm on CPU), hands every engine the
handle (``weight_call("ipc", "load", ...)``: its workers open the buffers and load from them) and
frees the buffers once every engine answered. `weight_sync.topology` says when it fits: an engine
on the sender's GPU (where NCCL refuses), or a CPU engine on the sender's host.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from skylift.utils.calls import gather_all
from skylift.weight_sync.buckets import NamedTensor, iter_buckets
from skylift.weight_sync.engine_side import WeightCall
from skylift.weight_sync.ipc.handles import (
    SharedTensors,
    fits,
    handle_to_wire,
    open_shared,
    share_tensors,
    write_tensors,
)
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.transport import WeightTransport

logger = logging.getLogger(__name__)


class SharedTensorsTransport(WeightTransport):
    """Tensors `put` here -> every engine of `engines` (on this host), by shared-memory handle.

    `dtype`: cast floating tensors to it first (None: as put). `keep_buffers` (the default; CPU
    buffers only): the shared buffers live on between pushes and the next push of the same layout
    is copied into them, so neither side touches fresh pages (one copy of the weights stays in
    shared memory meanwhile), and a push copies them bucket by bucket (`bucket_bytes`) while the
    engines load the buckets already copied; off, each push shares new buffers, filled at once,
    and frees them once loaded (`benchmarks/weight_sync.py`: kept 0.64 of the gloo stream's time
    on SmolLM2-135M, new buffers 1.70)."""

    kind = "ipc"

    def __init__(
        self,
        engines: Sequence[WeightCall],
        dtype: torch.dtype | None = None,
        keep_buffers: bool = True,
        bucket_bytes: int = 64 << 20,
    ) -> None:
        self.engines, self.dtype = list(engines), dtype
        self.keep_buffers = keep_buffers
        self._kept: SharedTensors | None = None
        self._ready: tuple[SharedTensors, torch.Tensor] | None = None  # the fill counter, shared
        self.bucket_bytes = bucket_bytes
        self.staged: list[NamedTensor] | None = None
        self.version: int | None = None  # the version the engines hold (None: what they started with)

    async def open(self) -> str:
        return f"weight sync: {len(self.engines)} engine(s) on this host load shared tensors by handle"

    def put(self, tensors: Mapping[str, torch.Tensor] | Iterable[NamedTensor]) -> None:
        """The tensors the next `push` sends (Hugging Face names; replaces any not yet pushed)."""
        named = tensors.items() if isinstance(tensors, Mapping) else tensors
        self.staged = list(named)

    def _prepare(self, named: list[NamedTensor]) -> tuple[SharedTensors, dict[str, torch.Tensor], bool]:
        """The buffers of this push: the kept ones when the layout is theirs (filled later, bucket
        by bucket), else new ones filled now. Returns (handle, tensors, filled)."""
        cast = self.dtype
        tensors = {n: t.to(cast) if cast is not None and t.is_floating_point() else t for n, t in named}
        if self._kept is not None and fits(self._kept, tensors):
            return self._kept, tensors, False
        if self._kept is not None:
            self._kept.release()
            self._kept = None
        handle = share_tensors(tensors)
        keep = bool(self.keep_buffers) and all(t.device.type == "cpu" for t in tensors.values())
        self._kept = handle if keep else None
        return handle, tensors, True

    def _counter(self) -> tuple[SharedTensors, torch.Tensor]:
        if self._ready is None:
            ready = share_tensors({"ready": torch.zeros(1, dtype=torch.int64)})
            self._ready = ready, open_shared(ready)["ready"]
        return self._ready

    def _fill(
        self, handle: SharedTensors, buckets: list[dict[str, torch.Tensor]], counter: torch.Tensor
    ) -> None:
        try:
            for k, bucket in enumerate(buckets):
                write_tensors(handle, bucket)
                counter[0] = k + 1  # the workers load bucket k while the next is copied
        except BaseException:
            counter[0] = -1
            raise

    async def push(self, version: int) -> dict[str, float]:
        """Every engine loads the tensors `put` last (and resets its prefix cache). Into kept
        buffers the tensors are copied bucket by bucket while the engines' workers load the
        buckets already there (one engine call: no model step sees half the weights)."""
        if self.staged is None:
            raise RuntimeError("SharedTensorsTransport.push before put: no tensors to send")
        named, self.staged = self.staged, None
        start = time.perf_counter()
        handle, tensors, filled = await asyncio.to_thread(self._prepare, named)
        del named
        buckets = [dict(b) for b in iter_buckets(tensors.items(), self.bucket_bytes)]
        payload: dict[str, Any] = {"handle": handle_to_wire(handle)}
        counter = None
        if handle is self._kept:  # CPU buffers: the workers may load while the rest is copied
            ready, counter = self._counter()
            counter[0] = len(buckets) if filled else 0
            payload.update(ready=handle_to_wire(ready), buckets=[list(b) for b in buckets])
        try:
            calls = asyncio.ensure_future(
                gather_all([e.weight_call("ipc", "load", payload) for e in self.engines])
            )
            if not filled:
                try:
                    await asyncio.to_thread(self._fill, handle, buckets, counter)  # type: ignore[arg-type]
                except BaseException:
                    await asyncio.gather(calls, return_exceptions=True)
                    raise
            results = await calls
        finally:
            if handle is not self._kept:
                handle.release()
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            raise WeightSyncError(f"shared-tensor weight sync: {failed[0]}") from failed[0]
        self.version = version
        return {
            "timing/weight_sync_s": time.perf_counter() - start,
            "weight_sync/bytes": float(handle.nbytes),
        }

    async def close(self) -> None:
        self.staged = None
        if self._kept is not None:
            failed = [
                r
                for r in await gather_all([e.weight_call("ipc", "release", {}) for e in self.engines])
                if isinstance(r, BaseException)
            ]
            if failed:  # the engine's mapping goes with it; closing goes on
                logger.warning(
                    "shared-tensor weight sync: an engine could not release the buffers: %s", failed[0]
                )
            self._kept.release()
            self._kept = None
        if self._ready is not None:
            self._ready[0].release()
            self._ready = None
