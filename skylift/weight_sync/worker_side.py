"""The vLLM workers' end of the generic weight call: one worker method for every transport that
keeps its worker half as an object (`weight_sync.factory.WORKER_RECEIVERS`).

An engine side (`weight_sync.engine_side`) reaches its workers with ``collective_rpc(
protocol.RPC_WORKER_CALL, args=(transport, method, *args))``; `WorkerReceivers.skylift_weight_rpc` builds
that transport's receiver once per worker (its class named by dotted path, imported on first use,
given the worker) and calls `method` on it. The receiver uses the worker's loading helpers
(`broadcast.receiver.WeightSyncWorkerExtension`: load units, direct load, vLLM's reload).
"""

from __future__ import annotations

import importlib
from typing import Any


class WorkerReceivers:
    """Mixed into the worker extension (`skylift.inference.vllm_worker`)."""

    def skylift_weight_rpc(self, transport: str, method: str, *args: Any) -> Any:
        from skylift.weight_sync.factory import WORKER_RECEIVERS

        receivers: dict[str, Any] = self.__dict__.setdefault("_skylift_receivers", {})
        receiver = receivers.get(transport)
        if receiver is None:
            path = WORKER_RECEIVERS.get(transport)
            if path is None:
                raise ValueError(f"no worker receiver for weight transport {transport!r}")
            module, _, name = path.rpartition(".")
            receiver = receivers[transport] = getattr(importlib.import_module(module), name)(self)
        return getattr(receiver, method)(*args)
