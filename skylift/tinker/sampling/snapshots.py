"""In-memory weight snapshots of ephemeral samplers (`save_weights_for_sampler` without a name).

A snapshot is *held* while the session that created its sampler is alive: the SDK has no call that
closes a sampling client, and a recipe keeps using a sampler across many later saves (DPO's
reference, async RL several steps off-policy). Held snapshots are never evicted. When a session
ends its snapshots become *idle*: at most `max_idle` of them stay (a later sample from a finished
session's sampler still works), oldest dropped first. All snapshots together stay within
`max_bytes`; a new one that does not fit even after dropping every idle one is refused with an
error naming the limit (``--snapshot-memory-mb``). The snapshots one user's live
sessions hold stay within `max_held_bytes_per_user` (``--max-snapshot-mb-per-user``; beyond it a
429): one user cannot take the whole memory from the others.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from skylift.tinker.core.auth import current_user
from skylift.tinker.core.fairness import QuotaError
from skylift.tinker.errors import UserError
from skylift.tinker.sampling.weights import SamplerSnapshot, tensors_nbytes

#: a snapshot's weights: merged full tensors, or a LoRA sampler's adapter (with or without them)
Weights = dict[str, torch.Tensor] | SamplerSnapshot

MIB = 1024 * 1024


@dataclass
class Snapshot:
    weights: Weights
    session_id: str
    nbytes: int
    owner: str | None = None


def weights_nbytes(weights: Weights) -> int:
    return weights.nbytes if isinstance(weights, SamplerSnapshot) else tensors_nbytes(weights)


class SnapshotStore:
    """Snapshots by tag (``ephemeral:<sampling session id>``)."""

    def __init__(self, max_bytes: int, max_idle: int, max_held_bytes_per_user: int | None = None) -> None:
        self.max_bytes = max_bytes
        self.max_idle = max_idle
        self.max_held_bytes_per_user = max_held_bytes_per_user
        self._held: dict[str, Snapshot] = {}
        self._idle: OrderedDict[str, Snapshot] = OrderedDict()

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in (*self._held.values(), *self._idle.values()))

    def stats(self) -> dict[str, int]:
        return {
            "held": len(self._held),
            "idle": len(self._idle),
            "bytes": self.nbytes,
            "max_bytes": self.max_bytes,
        }

    def add(self, tag: str, session_id: str, weights: Weights) -> None:
        owner = current_user.get()
        snap = Snapshot(weights, session_id, weights_nbytes(weights), owner)
        mine = sum(s.nbytes for t, s in self._held.items() if s.owner == owner and t != tag)
        quota = self.max_held_bytes_per_user
        if quota is not None and mine + snap.nbytes > quota:
            raise QuotaError(
                f"no room for another sampler snapshot ({snap.nbytes / MIB:.1f} MiB): your live sessions "
                f"hold {mine / MIB:.1f} MiB of the {quota / MIB:g} MiB this server allows per user "
                "(--max-snapshot-mb-per-user); finish sessions you no longer sample from, or save named "
                "sampler weights (save_weights_for_sampler(name)) instead"
            )
        self._held.pop(tag, None)
        self._idle.pop(tag, None)
        while self._idle and self.nbytes + snap.nbytes > self.max_bytes:
            self._idle.popitem(last=False)
        if self.nbytes + snap.nbytes > self.max_bytes:
            raise UserError(
                f"no room for another sampler snapshot ({snap.nbytes / MIB:.1f} MiB): {len(self._held)} "
                f"snapshots held by live sessions use {self.nbytes / MIB:.1f} MiB of the "
                f"{self.max_bytes / MIB:.0f} MiB limit (--snapshot-memory-mb); finish sessions you no longer "
                "sample from, or save named sampler weights (save_weights_for_sampler(name)) instead"
            )
        self._held[tag] = snap

    def get(self, tag: str) -> Weights | None:
        snap = self._held.get(tag) or self._idle.get(tag)
        return None if snap is None else snap.weights

    def release_session(self, session_id: str) -> None:
        """The session ended: its snapshots become idle (and the oldest idle ones beyond `max_idle` go)."""
        for tag in [t for t, s in self._held.items() if s.session_id == session_id]:
            self._idle[tag] = self._held.pop(tag)
        while len(self._idle) > self.max_idle:
            self._idle.popitem(last=False)
