"""Checkpoint-delta weight sync without vLLM: the publisher (`weight_sync.delta.publish`) and an
engine host's store (`weight_sync.delta.apply`) over a tiny Qwen2's weights, version by version."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from delta_fakes import sent, step, tiny_model

from skylift.weight_sync.delta.apply import DeltaStore
from skylift.weight_sync.delta.format import (
    CorruptPayloadError,
    DeltaError,
    DeltaVersionNotFound,
    as_bytes,
    read_manifest,
    version_dir,
)
from skylift.weight_sync.delta.publish import DeltaPublisher


def assert_store_equals(store: DeltaStore, model: torch.nn.Module) -> None:
    state = store.state()
    got = dict(store.tensors(store.all_names(), state.run_id, state.version))
    for name, tensor in sent(model):
        # bit-equal (a tensor that never changed comes from the base checkpoint, cast when loaded)
        assert torch.equal(as_bytes(got[name].to(tensor.dtype)), as_bytes(tensor)), name


@pytest.fixture
def setup(tmp_path: Path) -> tuple[torch.nn.Module, Path, Path]:
    base = tmp_path / "base"
    return tiny_model(base), base, tmp_path / "sync"


def test_versions_round_trip_bit_equal_and_only_changed_tensors_travel(setup, tmp_path: Path) -> None:
    model, base, sync = setup
    publisher = DeltaPublisher(sync, base, num_workers=2)
    store = DeltaStore(tmp_path / "store", base)
    q = "model.layers.0.self_attn.q_proj.weight"
    changes = [[q, "model.norm.weight"], ["lm_head.weight", "model.layers.1.mlp.up_proj.weight"], []]
    for v, names in enumerate(changes, start=1):
        step(model, names, seed=v)
        stats = publisher.publish(sent(model))
        manifest = read_manifest(sync, v)
        assert (stats.version, manifest.version, manifest.base_version) == (v, v, v - 1)
        # bf16 of the base checkpoint equals bf16 of the untouched weights: nothing else travels
        assert sorted(r.name for r in manifest.tensors) == sorted(names)
        assert stats.changed == len(names) and stats.tensors == len(model.state_dict())
        assert store.apply(sync, v) == [v]
        assert_store_equals(store, model)
        assert store.changed_since(sync, manifest.run_id, v - 1) == sorted(names)
    assert store.apply(sync, 3) == []  # already there
    assert sorted(store.changed_since(sync, publisher.run_id, 0) or []) == sorted(sum(changes, []))
    assert store.changed_since(sync, "another run", 0) is None


def test_a_store_that_missed_versions_replays_them_in_order(setup, tmp_path: Path) -> None:
    model, base, sync = setup
    publisher = DeltaPublisher(sync, base, max_file_bytes=64)  # several payload files per version
    early = DeltaStore(tmp_path / "early", base)
    names = [n for n, _ in model.named_parameters()]
    for v in range(1, 5):
        step(model, names[v : v + 3], seed=v)
        publisher.publish(sent(model))
        if v == 1:
            early.apply(sync, 1)
    assert len({r.file for r in read_manifest(sync, 4).tensors}) > 1
    late = DeltaStore(tmp_path / "late", base)
    assert late.apply(sync, 4) == [1, 2, 3, 4]
    assert early.apply(sync, 4) == [2, 3, 4]
    assert_store_equals(late, model)
    assert_store_equals(early, model)
    with pytest.raises(DeltaError, match="newer than the requested 2"):
        late.apply(sync, 2)
    with pytest.raises(DeltaVersionNotFound, match="version 9 is not published"):
        late.apply(sync, 9)


def test_a_corrupt_payload_is_refused_naming_its_file_and_the_store_is_unchanged(
    setup, tmp_path: Path
) -> None:
    model, base, sync = setup
    publisher = DeltaPublisher(sync, base)
    store = DeltaStore(tmp_path / "store", base)
    step(model, ["model.embed_tokens.weight"], seed=1)
    publisher.publish(sent(model))
    store.apply(sync, 1)
    step(model, ["model.layers.0.mlp.down_proj.weight"], seed=2)
    publisher.publish(sent(model))
    record = read_manifest(sync, 2).tensors[0]
    payload = version_dir(sync, 2) / record.file
    data = bytearray(payload.read_bytes())
    data[record.offset + record.length // 2] ^= 0xFF
    payload.write_bytes(bytes(data))
    with pytest.raises(CorruptPayloadError, match=f"payload {payload} is corrupt"):
        store.apply(sync, 2)
    assert store.state().version == 1  # left at the version before


def test_a_new_run_resets_a_store_and_another_base_is_caught(setup, tmp_path: Path) -> None:
    model, base, sync = setup
    store = DeltaStore(tmp_path / "store", base)
    first = DeltaPublisher(sync, base)
    step(model, ["model.norm.weight"], seed=1)
    first.publish(sent(model))
    first.publish(sent(model))
    store.apply(sync, 2)
    second = DeltaPublisher(sync, base)  # a new run in the same sync_dir starts at version 1
    step(model, ["lm_head.weight"], seed=2)
    second.publish(sent(model))
    assert not version_dir(sync, 2).exists()  # the earlier run's versions are gone
    assert store.apply(sync, 1) == [1]
    assert_store_equals(store, model)
    # an engine host whose base checkpoint differs from the trainer's
    other = DeltaStore(tmp_path / "other", None)
    with pytest.raises(DeltaError, match="does not match the trainer's after patching"):
        other.apply(sync, 1)
    assert json.loads((tmp_path / "other" / "state.json").read_text())["version"] == 0


def test_a_rebase_interval_keeps_at_most_that_many_versions_and_every_store_still_catches_up(
    setup, tmp_path: Path
) -> None:
    """rebase_interval=2: versions 2 and 4 are published against the base checkpoint and the
    versions before them deleted; a store at any earlier version reaches the newest one."""
    model, base, sync = setup
    publisher = DeltaPublisher(sync, base, rebase_interval=2)
    early, late = DeltaStore(tmp_path / "early", base), DeltaStore(tmp_path / "late", base)
    q, up = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.up_proj.weight"
    kept = []
    for v, names in enumerate([[q], [up], ["model.norm.weight"], [q]], start=1):
        step(model, names, seed=v)
        publisher.publish(sent(model))
        kept.append(sorted(int(p.name[6:]) for p in (sync / "deltas").glob("delta-*")))
        if v == 1:
            assert early.apply(sync, 1) == [1]
    assert kept == [[1], [2], [2, 3], [4]]
    assert read_manifest(sync, 4).base_version == 0
    assert sorted(r.name for r in read_manifest(sync, 4).tensors) == sorted([q, up, "model.norm.weight"])
    assert early.apply(sync, 4) == [4] and late.apply(sync, 4) == [4]  # from the base
    assert_store_equals(early, model)
    assert_store_equals(late, model)
    assert early.changed_since(sync, publisher.run_id, 1) is None  # version 1 is gone: load all
    step(model, [up], seed=9)
    publisher.publish(sent(model))  # version 5, against version 4 again
    assert read_manifest(sync, 5).base_version == 4 and early.apply(sync, 5) == [5]
    assert early.changed_since(sync, publisher.run_id, 4) == [up]
    assert_store_equals(early, model)


def test_a_delta_load_reads_in_chunks_that_never_split_a_fused_module() -> None:
    from skylift.weight_sync.delta.receiver import chunks

    def unit_of(name: str) -> str:  # q/k/v load into one fused module, as in vLLM
        module, _, _ = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        return f"{prefix}.qkv" if leaf in ("q", "k", "v") else module

    names = [f"l{i}.{p}.weight" for i in range(3) for p in ("q", "k", "v", "o")]
    tensors = [(n, torch.zeros(25)) for n in names]  # 100 bytes each
    out = list(chunks(iter(tensors), unit_of, max_bytes=250))
    assert [n for chunk in out for n, _ in chunk] == names  # all of them, in order
    for chunk in out:
        assert chunk[0][0].endswith((".q.weight", ".o.weight"))  # a chunk starts where a unit does
    assert [len(c) for c in out] == [3, 4, 4, 1]  # a chunk closes at the first unit boundary past 250 bytes
    assert [len(c) for c in chunks(iter(tensors), unit_of, max_bytes=10**9)] == [12]
    assert list(chunks(iter([]), unit_of)) == []
