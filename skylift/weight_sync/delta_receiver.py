"""The vLLM worker's half of checkpoint-delta weight sync: load tensors of the host's delta store.

The engine (`skylift.inference.delta_engine`) has brought the store to a version
(`weight_sync.delta_apply`) and names the tensors that changed since the version the engine
holds; every worker reads them from the store (shared lock; the base checkpoint for a tensor that
never changed) and loads them in place, as a weight stream's bucket is loaded: straight into the
modules where `direct_load` maps them, else through vLLM's reload. A fused module (q/k/v, gate/up)
is always loaded whole: its parts that did not change are read too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from skylift.weight_sync.buckets import bucket_of
from skylift.weight_sync.delta_apply import DeltaStore
from skylift.weight_sync.receiver import WeightSyncWorkerExtension


class DeltaReceiverExtension(WeightSyncWorkerExtension):
    """`skylift_load_delta` on every vLLM worker (`protocol.RPC_LOAD_DELTA`)."""

    def skylift_load_delta(
        self, store_dir: str, base_dir: str | None, names: list[str], run_id: str, version: int
    ) -> dict[str, Any]:
        """Load `names` (plus the unchanged parts of their fused modules) as of `version` of
        `run_id` from the store; returns {"tensors", "bytes", "seconds", "direct"}."""
        start = time.perf_counter()
        wanted = set(names)
        for _module, (_sent, missing) in self._skylift_load_units().partial_units(names).items():
            wanted.update(missing)
        store = DeltaStore(store_dir, Path(base_dir) if base_dir else None)
        tensors = list(store.tensors(sorted(wanted), run_id, version))
        if not tensors:
            return {"tensors": 0, "bytes": 0, "seconds": 0.0, "direct": False}
        direct = self._skylift_direct_loader()
        with self._skylift_loading():
            loads = direct.plan(bucket_of(tensors)) if direct is not None else None
            if loads is None:
                self._skylift_reload(tensors)
            else:
                direct.load(loads, tensors)
                self._skylift_reset_runner_caches()
        return {
            "tensors": len(tensors),
            "bytes": sum(t.numel() * t.element_size() for _, t in tensors),
            "seconds": time.perf_counter() - start,
            "direct": loads is not None,
        }
