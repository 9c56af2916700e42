"""The IPC transport's worker half: open the shared tensors a handle names and load them.

Built once per vLLM worker by `weight_sync.worker_side` (the engine side calls ``load`` through
``RPC_WORKER_CALL``). The tensors stay where the sender put them (its GPU, or /dev/shm): they are
loaded straight into the model's modules where `broadcast.direct_load` maps them, else through
vLLM's reload, which copies them into the parameters; the views are dropped before the call
returns, so the sender may release its buffers once every worker answered.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from skylift.weight_sync.broadcast.direct_load import load_direct_then_reload
from skylift.weight_sync.buckets import Piece, bucket_of
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
        self._ready: tuple[str, Any] | None = None  # the sender's fill counter, mapped once

    def _counter(self, ready: dict[str, Any]) -> Any:
        key = _key(ready)
        if self._ready is None or self._ready[0] != key:
            self._ready = key, open_shared(handle_from_wire(ready))["ready"]
        return self._ready[1]

    def release(self) -> bool:
        """Drop the kept views (the sender closed: its buffers' pages are freed once no process
        maps them); whether any were open."""
        held = self._open is not None or self._ready is not None
        self._open = self._ready = None
        return held

    def place(self) -> dict[str, Any]:
        """Where this worker's model lives (`ipc.place.place_of`): the transport rule's input."""
        from skylift.weight_sync.ipc.place import place_of

        worker = self.worker
        device = getattr(worker, "device", None) or getattr(getattr(worker, "worker", None), "device", None)
        return place_of(device)

    def _views(self, wire: dict[str, Any]) -> dict[str, Any]:
        key = _key(wire)
        if self._open is not None and self._open[0] == key:
            return self._open[1]
        self._open = None  # the old mapping goes before the new one is made
        views = open_shared(handle_from_wire(wire))
        if all(b["device"] == "cpu" for b in wire["buffers"]):
            self._open = (key, views)
        return views

    def load(
        self,
        wire: dict[str, Any],
        ready: dict[str, Any] | None = None,
        buckets: list[list[str]] | None = None,
    ) -> dict[str, Any]:
        """Load every tensor of the handle `wire` (`handles.handle_to_wire`); returns
        {"tensors", "bytes", "seconds", "direct"}. With `ready` (the handle of a one-element
        counter in shared memory) and `buckets` (the names in the order the sender fills them),
        bucket k is loaded once the counter reaches k + 1, while the sender still fills the next
        ones (-1: the sender failed); from a bucket the direct loader cannot take, the rest is one
        vLLM reload that takes each bucket as the sender fills it."""
        start = time.perf_counter()
        views = self._views(wire)
        worker = self.worker
        worker._skylift_check_whole_units(list(views))
        counter = self._counter(ready) if ready is not None else None
        order = buckets if buckets is not None else [list(views)]
        nbytes = 0

        def pieces() -> Iterator[Piece]:
            """Each bucket once the sender has filled it."""
            nonlocal nbytes
            for k, names in enumerate(order):
                if counter is not None:
                    _wait_for(counter, k + 1, start)
                named = [(n, views[n]) for n in names]
                nbytes += sum(t.numel() * t.element_size() for _, t in named)
                if named:
                    yield bucket_of(named), named

        loaded, reloaded = load_direct_then_reload(worker, pieces())
        return {
            "tensors": len(wire["order"]),
            "bytes": nbytes,
            "seconds": time.perf_counter() - start,
            "direct": loaded > 0 and not reloaded,
        }


#: how long a worker waits for the sender to fill the next bucket
FILL_TIMEOUT_S = 120.0


def _wait_for(counter: Any, value: int, start: float) -> None:
    while True:
        seen = int(counter[0])
        if seen == -1:
            raise RuntimeError("the sender failed while filling the shared buffers: nothing more to load")
        if seen >= value:
            return
        if time.perf_counter() - start > FILL_TIMEOUT_S:
            raise RuntimeError(f"the sender filled {seen} of the shared buckets within {FILL_TIMEOUT_S:g} s")
        time.sleep(0.0002)
