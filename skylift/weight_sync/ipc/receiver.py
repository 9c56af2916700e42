"""The IPC transport's worker half: open the shared tensors a handle names and load them.

Built once per vLLM worker by `weight_sync.worker_side` (the engine side calls ``load`` through
``RPC_WORKER_CALL``). The tensors stay where the sender put them (its GPU, or /dev/shm): they are
loaded straight into the model's modules where `broadcast.direct_load` maps them, else through
vLLM's reload, which copies them into the parameters; the views are dropped before the call
returns, so the sender may release its buffers once every worker answered.
"""

from __future__ import annotations

import time
from typing import Any

from skylift.weight_sync.buckets import bucket_of
from skylift.weight_sync.ipc.handles import handle_from_wire, open_shared


def _key(wire: dict[str, Any]) -> str:
    return repr([(b["device"], b["args"]) for b in wire["buffers"]])


class IpcWorkerReceiver:
    """Keeps the last CPU handle's views open: a sender that refills the same buffers
    (`SharedTensorsTransport(keep_buffers=True)`) is read without mapping anything again. CUDA
    views are dropped after each load (an open one would keep the sender's GPU memory alive)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker  # the vLLM worker, with `broadcast.receiver`'s loading helpers
        self._open: tuple[str, dict[str, Any]] | None = None

    def _views(self, wire: dict[str, Any]) -> dict[str, Any]:
        key = _key(wire)
        if self._open is not None and self._open[0] == key:
            return self._open[1]
        self._open = None  # the old mapping goes before the new one is made
        views = open_shared(handle_from_wire(wire))
        if all(b["device"] == "cpu" for b in wire["buffers"]):
            self._open = (key, views)
        return views

    def load(self, wire: dict[str, Any]) -> dict[str, Any]:
        """Load every tensor of the handle `wire` (`handles.handle_to_wire`); returns
        {"tensors", "bytes", "seconds", "direct"}."""
        start = time.perf_counter()
        named = list(self._views(wire).items())
        worker = self.worker
        worker._skylift_check_whole_units([n for n, _ in named])
        direct = worker._skylift_direct_loader()
        loads = direct.plan(bucket_of(named)) if direct is not None and named else None
        with worker._skylift_loading():
            if loads is not None:
                direct.load(loads, named)
                worker._skylift_reset_runner_caches()
            elif named:
                worker._skylift_reload(iter(named))
        nbytes = sum(t.numel() * t.element_size() for _, t in named)
        del named
        return {
            "tensors": len(wire["order"]),
            "bytes": nbytes,
            "seconds": time.perf_counter() - start,
            "direct": loads is not None,
        }
