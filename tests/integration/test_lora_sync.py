"""LoRA-only weight sync from a LoRA policy worker into an in-process vLLM engine started with LoRA.

The policy (an `RLWorker` with a rank-8 PEFT adapter, driven as the trainer's driver drives it, on the tiny model, fp32) sends only its
adapter, in memory over the weight-update group or through a directory; the engine then samples
with it as its default adapter. Run inside a loopback-only namespace:
    bash scripts/test.sh tests/integration/test_lora_sync.py
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lora_helpers import (
    RANK,
    TOLERANCE,
    LoraPolicy,
    adapter_bytes,
    lora_policy,
    max_error,
    perturb_adapter,
)

from skylift.inference.engine_args import lora_engine_args
from skylift.inference.local import LocalVLLMEngine
from skylift.inference.ray_engine import EngineActor
from skylift.inference.types import EngineRequestError, EngineStateError
from skylift.weight_sync.lora.adapter import write_adapter_dir
from skylift.weight_sync.lora.calls import load_adapter, unload_adapter
from skylift.weight_sync.lora.engine import LoraAdapterNotFoundError
from skylift.weight_sync.process_group import WeightSyncError

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def lora_engine(tiny_model_dir: Path, loop: Any) -> Iterator[LocalVLLMEngine]:
    from server_helpers import require_loopback_namespace

    require_loopback_namespace()
    engine = loop.run(
        LocalVLLMEngine.create(
            str(tiny_model_dir),
            name="lora-engine",
            max_model_len=512,
            seed=0,
            dtype="float32",
            max_num_seqs=8,
            enforce_eager=True,
            **lora_engine_args(RANK),
        ),
        timeout_s=600.0,
    )
    yield engine
    loop.run(engine.close())


@pytest.fixture(scope="module")
def policy(tiny_model_dir: Path, loop: Any, lora_engine: LocalVLLMEngine) -> Iterator[LoraPolicy]:
    """A LoRA policy rank 0 in this process, in a weight-update group with the engine."""
    with lora_policy(tiny_model_dir, loop, [lora_engine], override_existing=False) as policy:
        yield policy


def test_in_memory_sync_sends_only_the_adapter(
    lora_engine: LocalVLLMEngine, loop: Any, policy: LoraPolicy
) -> None:
    metrics = policy.sync_weights()
    assert metrics["weight_sync/bytes"] == adapter_bytes(policy)
    first = lora_engine.lora.default
    assert first is not None and lora_engine.lora.names() == [first]
    assert max_error(lora_engine, loop, policy) < TOLERANCE
    # the adapter is in effect: the base model ("") disagrees with the trainer
    assert max_error(lora_engine, loop, policy, lora_name="") > 1e-2

    # a new version replaces the old one under a new name
    perturb_adapter(policy, seed=2)
    assert max_error(lora_engine, loop, policy) > 1e-2  # the engine still serves version 1
    metrics = policy.sync_weights()
    assert metrics["weight_sync/bytes"] == adapter_bytes(policy)
    second = lora_engine.lora.default
    assert second is not None and second != first
    assert max_error(lora_engine, loop, policy) < TOLERANCE
    # the previous version stays until the next sync (requests running with it can finish)
    assert lora_engine.lora.names() == [first, second]
    assert max_error(lora_engine, loop, policy, lora_name=first) > 1e-2
    policy.sync_weights()
    assert lora_engine.lora.names() == [second, lora_engine.lora.default]
    with pytest.raises(LoraAdapterNotFoundError, match="no LoRA adapter named"):
        max_error(lora_engine, loop, policy, lora_name=first)


def test_directory_sync(lora_engine: LocalVLLMEngine, loop: Any, policy: LoraPolicy, tmp_path: Path) -> None:
    perturb_adapter(policy, seed=3)
    metrics = policy.sync_weights(lora_sync_path=str(tmp_path))
    assert metrics["weight_sync/bytes"] == adapter_bytes(policy)
    name = lora_engine.lora.default
    assert name is not None and (tmp_path / name / "adapter_config.json").is_file()
    assert max_error(lora_engine, loop, policy) < TOLERANCE
    for seed in (4, 5):
        perturb_adapter(policy, seed=seed)
        policy.sync_weights(lora_sync_path=str(tmp_path))
        assert max_error(lora_engine, loop, policy) < TOLERANCE
    assert not (tmp_path / name).exists()  # a version two syncs old is unloaded and deleted
    assert len(list(tmp_path.iterdir())) == 2


def test_load_refusals(lora_engine: LocalVLLMEngine, loop: Any, tmp_path: Path) -> None:
    with pytest.raises(LoraAdapterNotFoundError, match="no LoRA adapter at"):
        loop.run(load_adapter(lora_engine, "x", str(tmp_path / "missing")))
    current = lora_engine.lora.default
    assert current is not None
    with pytest.raises(EngineRequestError, match="already been loaded"):
        loop.run(load_adapter(lora_engine, current, str(tmp_path)))
    with pytest.raises(LoraAdapterNotFoundError, match="cannot be found"):
        loop.run(unload_adapter(lora_engine, "never-loaded"))


def test_an_adapter_received_in_memory_is_in_no_file_and_never_evicted(
    lora_engine: LocalVLLMEngine, loop: Any, policy: LoraPolicy, tmp_path: Path
) -> None:
    for seed in (6, 7):
        perturb_adapter(policy, seed=seed)
        policy.sync_weights()
    names = lora_engine.lora.names()
    assert len(names) == 2 and lora_engine.lora.default == names[-1]
    assert not any(os.path.exists(lora_engine.lora.request_for(n).lora_path) for n in names)
    assert max_error(lora_engine, loop, policy) < TOLERANCE
    # a third adapter would make vLLM's cache evict one it could not reload: refused
    tensors, config = policy.lora_adapter()
    write_adapter_dir(str(tmp_path / "extra"), tensors, config)
    with pytest.raises(EngineStateError, match="max_cpu_loras=2"):
        loop.run(load_adapter(lora_engine, "extra", str(tmp_path / "extra")))
    assert lora_engine.lora.names() == names


def test_refused_adapters_leave_the_group_usable_and_the_engine_serving(
    lora_engine: LocalVLLMEngine, loop: Any, policy: LoraPolicy
) -> None:
    """An adapter refused before the workers are called (the engine's cache is full) or by them (a
    rank above max_lora_rank): the broadcast is taken in all the same (no sender waits for its
    timeout), the engine keeps serving the current adapter, and the next sync works."""
    from skylift.weight_sync.lora.adapter import LoraPublisher

    perturb_adapter(policy, seed=8)
    policy.sync_weights()
    current = lora_engine.lora.default
    tensors, config = policy.lora_adapter()
    group = policy.worker.broadcaster.group  # type: ignore[union-attr]
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="max_cpu_loras=2"):  # a publisher retiring nothing
        loop.run(LoraPublisher().publish([lora_engine], tensors, config, group=group, timeout_s=120.0))
    with pytest.raises(WeightSyncError, match="max_lora_rank"):
        publisher = policy.link.publisher
        assert publisher is not None
        loop.run(publisher.publish([lora_engine], tensors, {**config, "r": 64}, group=group, timeout_s=120.0))
    assert time.monotonic() - started < 60.0
    assert lora_engine.lora.default == current
    assert max_error(lora_engine, loop, policy) < TOLERANCE
    perturb_adapter(policy, seed=9)
    policy.sync_weights()  # the group still carries the next sync
    assert lora_engine.lora.default != current
    assert max_error(lora_engine, loop, policy) < TOLERANCE


def test_ray_engine_actor_forwards_the_lora_calls(lora_engine: LocalVLLMEngine, loop: Any) -> None:
    """What a Ray engine actor runs for the sender's LoRA calls (the actor class, without Ray)."""
    actor = EngineActor()
    actor.engine = lora_engine
    with pytest.raises(LoraAdapterNotFoundError):
        loop.run(unload_adapter(actor, "never-loaded"))
    for operation in ("load", "unload", "receive"):
        assert callable(lora_engine.weights["lora"].operations[operation])
