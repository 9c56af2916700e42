"""Ephemeral sampler snapshots: held ones are never dropped, idle ones are bounded, a full store refuses."""

from __future__ import annotations

import pytest
import torch

from skylift.tinker.errors import UserError
from skylift.tinker.sampling.snapshots import MIB, SnapshotStore


def _weights(mib: int) -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(mib * MIB // 4, dtype=torch.float32)}


def test_held_snapshots_survive_any_number_of_newer_ones() -> None:
    store = SnapshotStore(max_bytes=100 * MIB, max_idle=1)
    store.add("ephemeral:ref", "s1", _weights(1))
    for i in range(20):  # DPO: an evaluation sampler per step, the reference one held throughout
        store.add(f"ephemeral:eval{i}", "s1", _weights(1))
    assert store.get("ephemeral:ref") is not None
    assert store.stats()["held"] == 21


def test_finished_sessions_leave_at_most_max_idle_snapshots() -> None:
    store = SnapshotStore(max_bytes=100 * MIB, max_idle=2)
    for i in range(4):
        store.add(f"ephemeral:{i}", "s1", _weights(1))
    store.add("ephemeral:other", "s2", _weights(1))
    store.release_session("s1")
    assert [store.get(f"ephemeral:{i}") is not None for i in range(4)] == [False, False, True, True]
    assert store.get("ephemeral:other") is not None


def test_a_snapshot_that_does_not_fit_is_refused_after_dropping_idle_ones() -> None:
    store = SnapshotStore(max_bytes=3 * MIB, max_idle=4)
    store.add("ephemeral:old", "s0", _weights(1))
    store.release_session("s0")
    store.add("ephemeral:a", "s1", _weights(1))
    store.add("ephemeral:b", "s1", _weights(1))
    store.add("ephemeral:c", "s1", _weights(1))  # fits once the idle one is dropped
    assert store.get("ephemeral:old") is None
    with pytest.raises(UserError, match="--snapshot-memory-mb"):
        store.add("ephemeral:d", "s1", _weights(1))
    assert all(store.get(f"ephemeral:{t}") is not None for t in "abc")


def test_an_adapter_only_snapshot_counts_the_adapter_bytes() -> None:
    from skylift.tinker.sampling.weights import AdapterSource, SamplerSnapshot

    adapter = AdapterSource(rank=8, tensors=_weights(1), config={"r": 8})
    store = SnapshotStore(max_bytes=3 * MIB, max_idle=4)
    for i in range(3):  # three LoRA samplers' adapters fit where merged weights of 2 MiB would not
        store.add(f"ephemeral:{i}", "s1", SamplerSnapshot(None, adapter))
    assert store.stats()["bytes"] == 3 * MIB
    with pytest.raises(UserError, match="--snapshot-memory-mb"):
        store.add("ephemeral:full", "s1", SamplerSnapshot(_weights(1), adapter))
