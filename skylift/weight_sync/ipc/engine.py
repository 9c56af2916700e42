"""The IPC transport's engine half: full weights by handle from a process on the same host.

Operation ``places``: where each worker runs (`ipc.place`), for the transport rule. Operation
``load`` {"handle": `handles.handle_to_wire(...)`, "ready"?, "buckets"?}: every worker
opens the shared tensors (CUDA IPC on a GPU, /dev/shm on CPU) and loads them (`ipc.receiver`;
with a `ready` counter, bucket by bucket while the sender fills the next), then the prefix cache
is reset. Operation ``release``: the workers drop the views they keep open of the sender's
buffers (the sender closed). No weight-update group: the sender keeps the buffers alive until this call answers. A
handle that does not decode is an `EngineRequestError`; a worker's failure (e.g. a bucket that
holds part of a fused module) an `EngineStateError`, nothing loaded on that worker.
"""

from __future__ import annotations

import time
from typing import Any

from skylift.utils.engine_errors import EngineError, EngineRequestError, EngineStateError
from skylift.weight_sync.engine_side import EngineHost, EngineSide, Payload, WeightState
from skylift.weight_sync.ipc.handles import handle_from_wire
from skylift.weight_sync.protocol import RPC_WORKER_CALL


class IpcEngineSide(EngineSide):
    transport = "ipc"

    def __init__(self, host: EngineHost, state: WeightState) -> None:
        super().__init__(host, state)
        self.operations = {"load": self.load, "places": self.places, "release": self.release}

    async def places(self, payload: Payload) -> list[dict[str, Any]]:
        """Where each of the engine's workers runs (`ipc.place.place_of`), in worker order: what
        `weight_sync.topology` chooses a transport from."""
        return list(
            await self.host.rpc("ipc places", RPC_WORKER_CALL, ("ipc", "place"), self.host.control_timeout_s)
        )

    async def release(self, payload: Payload) -> dict[str, Any]:
        """Every worker drops the views it keeps open of a sender's buffers (the sender is done
        with them: without this a long-lived engine would hold a closed run's weights in memory
        until its next shared-memory load)."""
        async with self.state.lock:
            held = await self.host.rpc(
                "ipc release", RPC_WORKER_CALL, ("ipc", "release"), self.host.control_timeout_s
            )
        return {"released": any(held)}

    async def load(self, payload: Payload) -> dict[str, Any]:
        wire, ready, buckets = payload.get("handle"), payload.get("ready"), payload.get("buckets")
        try:
            tensors = len(handle_from_wire(wire).order)  # type: ignore[arg-type]
            if ready is not None:
                handle_from_wire(ready)
            if buckets is not None and sorted(n for b in buckets for n in b) != sorted(wire["order"]):  # type: ignore[index]
                raise ValueError("the buckets do not name the handle's tensors")
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise EngineRequestError(
                f"{self.host.name}: ipc load: not a shared-tensors handle ({exc!r})"
            ) from exc
        async with self.state.lock:
            start = time.perf_counter()
            try:
                results = await self.host.rpc(
                    f"ipc load ({tensors} tensors)",
                    RPC_WORKER_CALL,
                    ("ipc", "load", wire, ready, buckets),  # the fill counter reaches the workers
                    self.host.update_timeout_s,
                )
            except EngineError as exc:
                if type(exc) is not EngineError:
                    raise
                raise EngineStateError(str(exc)) from exc
            self.state.version += 1
            reset = await self.host.try_reset_prefix_cache()
        return {
            "tensors": tensors,
            "bytes": int(results[0]["bytes"]),
            "seconds": time.perf_counter() - start,
            "worker_seconds": max(r["seconds"] for r in results),
            "direct": all(r["direct"] for r in results),
            "weight_version": self.state.version,
            "prefix_cache_reset": reset,
        }
