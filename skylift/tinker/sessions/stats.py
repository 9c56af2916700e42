"""The server's sharing figures (GET /api/v1/server_stats): what training holds and who uses it;
and skylift's own status (GET /skylift/status).

Training: the memory budget and what admitted clients hold (`skylift.tinker.training.admission`), the
base models resident for LoRA clients with their client counts, loads and evictions
(`skylift.tinker.training.base_pool`), and the training thread's slot. Sampling: each engine's request
slots, how it serves LoRA samplers (adapters in the batch or weight swaps, and the start-up
measurement that chose) with its adapter slots (in use, loads, hits, evictions), and the
ephemeral sampler snapshots. Counts of other users are totals only; the caller's
own clients, adapters and caps are under "you".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from skylift.tinker.core.fairness import FairGate
from skylift.tinker.sampling.service import SamplingService
from skylift.tinker.sampling.snapshots import SnapshotStore
from skylift.tinker.training.registry import ModelRegistry


def _slots(gate: FairGate) -> dict[str, int]:
    return {"total": gate.slots, "in_use": gate.busy, "waiting": gate.waiting}


class ServerStats:
    """What the stats and status routes read, each part from its owner."""

    def __init__(
        self,
        registry: ModelRegistry,
        train_gate: FairGate,
        sampling: SamplingService,
        snapshots: SnapshotStore,
    ) -> None:
        self.registry, self.train_gate, self.sampling, self.snapshots = (
            registry,
            train_gate,
            sampling,
            snapshots,
        )

    def server_stats(self, user: str) -> dict[str, Any]:
        registry = self.registry
        training = {
            **registry.admission.stats(user),
            **registry.pool.stats(),
            "slots": _slots(self.train_gate),
        }
        hosts = self.sampling.engines
        sampling = {
            "engines": [
                {
                    "base_model": path,
                    "started": path in hosts and hosts[path].started,
                    "slots": _slots(gate),
                    **(hosts[path].stats() if path in hosts else {}),
                }
                for path, gate in self.sampling.gates.items()
            ],
            "snapshots": self.snapshots.stats(),
        }
        return {"training": training, "sampling": sampling}

    def status(self, mine: Callable[[list[str]], list[str]]) -> dict[str, Any]:
        """Which engines and render servers started (tests check that training never starts an
        engine, and text-only training no render server) and the caller's loaded models
        (`mine(loaded model ids)`: those the caller owns; blocking)."""
        engines = self.sampling.engines.values()
        return {
            "engines": [
                {
                    "base_model": h.base_model,
                    "started": h.started,
                    "start_attempts": h.start_attempts,
                    "last_error": h.last_error,
                }
                for h in engines
            ],
            "engine_start_attempts": sum(h.start_attempts for h in engines),
            "loaded_models": mine(list(self.registry.models)),
            "renderers": [r.status() for r in self.registry.render_hosts.hosts.values()],
            "snapshots": self.snapshots.stats(),
        }
