"""The server's sharing figures (GET /api/v1/server_stats): what training holds and who uses it.

Training: the memory budget and what admitted clients hold (`skylift.tinker.training.admission`), the
base models resident for LoRA clients with their client counts, loads and evictions
(`skylift.tinker.training.base_pool`), and the training thread's slot. Sampling: each engine's request
slots, how it serves LoRA samplers (adapters in the batch or weight swaps, and the start-up
measurement that chose) with its adapter slots (in use, loads, hits, evictions), and the
ephemeral sampler snapshots. Counts of other users are totals only; the caller's
own clients, adapters and caps are under "you".
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from skylift.tinker.core.fairness import FairGate
    from skylift.tinker.service import TinkerService


def _slots(gate: FairGate) -> dict[str, int]:
    return {"total": gate.slots, "in_use": gate.busy, "waiting": gate.waiting}


def server_stats(service: TinkerService, user: str) -> dict[str, Any]:
    training = {**service.admission.stats(user), **service.pool.stats(), "slots": _slots(service.train_gate)}
    hosts = service.sampling.engines
    sampling = {
        "engines": [
            {
                "base_model": path,
                "started": path in hosts and hosts[path].started,
                "slots": _slots(gate),
                **(hosts[path].stats() if path in hosts else {}),
            }
            for path, gate in service.sampling.gates.items()
        ],
        "snapshots": service.snapshots.stats(),
    }
    return {"training": training, "sampling": sampling}
