"""The vLLM worker's half of checkpoint-delta weight sync: load tensors of the host's delta store.

The engine (`skylift.weight_sync.delta.engine`) has brought the store to a version
(`weight_sync.delta.apply`) and names the tensors that changed since the version the engine
holds; every worker reads them from the store (shared lock; the base checkpoint for a tensor that
never changed) and loads them in place, as a weight stream's bucket is loaded: straight into the
modules where `broadcast.direct_load` maps them, else through vLLM's reload. A fused module (q/k/v, gate/up)
is always loaded whole: its parts that did not change are read too.

The tensors are read and loaded in chunks of about `LOAD_CHUNK_BYTES` (a fused module's tensors
stay in one chunk), so a full load (a fresh engine, or a version published against the base)
holds one chunk in memory at a time, not the whole model. Chunks go straight into the modules
while `direct_load` maps them; from the first one it does not, the rest is one vLLM reload that
reads them as it goes.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from skylift.weight_sync.broadcast.direct_load import load_direct_then_reload
from skylift.weight_sync.broadcast.receiver import WeightSyncWorkerExtension
from skylift.weight_sync.buckets import NamedTensor, bucket_of
from skylift.weight_sync.delta.apply import DeltaStore

LOAD_CHUNK_BYTES = 256 << 20
"""About how many bytes of tensors one chunk of a delta load holds (a fused module is never split)."""


def chunks(
    tensors: Iterable[NamedTensor], unit_of: Callable[[str], str], max_bytes: int = LOAD_CHUNK_BYTES
) -> Iterator[list[NamedTensor]]:
    """`tensors` (a unit's tensors adjacent) in lists of about `max_bytes`, a new list starting
    only where a unit starts: a chunk ends at the first unit boundary at or past `max_bytes`."""
    chunk: list[NamedTensor] = []
    size, unit = 0, None
    for name, tensor in tensors:
        current = unit_of(name)
        if chunk and size >= max_bytes and current != unit:
            yield chunk
            chunk, size = [], 0
        chunk.append((name, tensor))
        size += tensor.numel() * tensor.element_size()
        unit = current
    if chunk:
        yield chunk


class DeltaReceiverExtension(WeightSyncWorkerExtension):
    """`skylift_load_delta` on every vLLM worker (`protocol.RPC_LOAD_DELTA`)."""

    def skylift_load_delta(
        self, store_dir: str, base_dir: str | None, names: list[str], run_id: str, version: int
    ) -> dict[str, Any]:
        """Load `names` (plus the unchanged parts of their fused modules) as of `version` of
        `run_id` from the store, chunk by chunk; returns {"tensors", "bytes", "seconds",
        "direct", "chunks"}."""
        start = time.perf_counter()
        units = self._skylift_load_units()
        wanted = set(names)
        for _module, (_sent, missing) in units.partial_units(names).items():
            wanted.update(missing)
        ordered = sorted(wanted, key=lambda name: (units.unit_of(name), name))  # a unit's adjacent
        store = DeltaStore(store_dir, Path(base_dir) if base_dir else None)
        counted = {"tensors": 0, "bytes": 0, "chunks": 0}

        def count(chunk: list[NamedTensor]) -> list[NamedTensor]:
            counted["tensors"] += len(chunk)
            counted["bytes"] += sum(t.numel() * t.element_size() for _, t in chunk)
            counted["chunks"] += 1
            return chunk

        parts = map(count, chunks(store.tensors(ordered, run_id, version), units.unit_of))
        loaded_directly, reloaded = load_direct_then_reload(
            self, ((bucket_of(chunk), chunk) for chunk in parts)
        )
        return {
            **counted,
            "seconds": time.perf_counter() - start if ordered else 0.0,
            "direct": loaded_directly > 0 and not reloaded,
        }
