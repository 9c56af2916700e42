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
import time
from collections.abc import Iterable, Mapping, Sequence

import torch

from skylift.utils.calls import gather_all
from skylift.weight_sync.buckets import NamedTensor
from skylift.weight_sync.engine_side import WeightCall
from skylift.weight_sync.ipc.handles import SharedTensors, handle_to_wire, share_tensors
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.transport import WeightTransport


class SharedTensorsTransport(WeightTransport):
    """Tensors `put` here -> every engine of `engines` (on this host), by shared-memory handle.

    `dtype`: cast floating tensors to it first (None: as put). `keep_buffers` (default: on CPU):
    the shared buffers live on between pushes and the next push of the same layout is copied
    into them, so neither side touches fresh pages (one copy of the weights stays in shared
    memory meanwhile); off, each push shares new buffers and frees them once loaded."""

    def __init__(
        self,
        engines: Sequence[WeightCall],
        dtype: torch.dtype | None = None,
        keep_buffers: bool | None = None,
    ) -> None:
        self.engines, self.dtype = list(engines), dtype
        self.keep_buffers = keep_buffers
        self._kept: SharedTensors | None = None
        self.staged: list[NamedTensor] | None = None
        self.version: int | None = None  # the version the engines hold (None: what they started with)

    async def open(self) -> str:
        return f"weight sync: {len(self.engines)} engine(s) on this host load shared tensors by handle"

    def put(self, tensors: Mapping[str, torch.Tensor] | Iterable[NamedTensor]) -> None:
        """The tensors the next `push` sends (Hugging Face names; replaces any not yet pushed)."""
        named = tensors.items() if isinstance(tensors, Mapping) else tensors
        self.staged = list(named)

    def _share(self, named: list[NamedTensor]) -> SharedTensors:
        cast = self.dtype
        tensors = {n: t.to(cast) if cast is not None and t.is_floating_point() else t for n, t in named}
        keep = self.keep_buffers
        if keep is None:
            keep = all(t.device.type == "cpu" for t in tensors.values())
        handle = share_tensors(tensors, reuse=self._kept)
        if handle is not self._kept and self._kept is not None:
            self._kept.release()
        self._kept = handle if keep else None
        return handle

    async def push(self, version: int) -> dict[str, float]:
        """Every engine loads the tensors `put` last (and resets its prefix cache)."""
        if self.staged is None:
            raise RuntimeError("SharedTensorsTransport.push before put: no tensors to send")
        named, self.staged = self.staged, None
        start = time.perf_counter()
        handle = await asyncio.to_thread(self._share, named)
        del named
        try:
            payload = {"handle": handle_to_wire(handle)}
            results = await gather_all([e.weight_call("ipc", "load", payload) for e in self.engines])
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
            self._kept.release()
            self._kept = None
