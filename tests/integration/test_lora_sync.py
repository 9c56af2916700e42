"""LoRA-only weight sync from a LoRA policy worker into an in-process vLLM engine started with LoRA.

The policy (an `RLWorker` with a rank-8 PEFT adapter on the tiny model, fp32) sends only its
adapter, in memory over the weight-update group or through a directory; the engine then samples
with it as its default adapter. Run inside a loopback-only namespace:
    bash scripts/test.sh tests/integration/test_lora_sync.py
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from lora_helpers import RANK, SEQUENCES, TOLERANCE, adapter_bytes, perturb_adapter, trainer_logprobs

from skylift.inference.engine_args import lora_engine_args
from skylift.inference.local import LocalVLLMEngine
from skylift.inference.lora_adapters import LoraAdapterNotFoundError
from skylift.inference.types import EngineRequestError
from skylift.trainer.engines import EngineActor, EngineRef
from skylift.trainer.workers import RLWorker
from skylift.training.worker import WorkerSettings

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
def policy(tiny_model_dir: Path, loop: Any, lora_engine: LocalVLLMEngine) -> Iterator[RLWorker]:
    """A LoRA policy rank 0 in this process, in a weight-update group with the engine."""
    worker = RLWorker(
        WorkerSettings(model_path=str(tiny_model_dir), lora_rank=RANK, lora_alpha=16), loop=loop.loop
    )
    worker.setup()
    perturb_adapter(worker, seed=1)
    worker.init_weight_sync(
        [EngineRef(name="lora-engine", engine=lora_engine)],
        override_existing=False,
        backend="gloo",
        timeout_s=60.0,
        master_address="127.0.0.1",
    )
    yield worker
    worker.close_weight_sync()


def max_error(engine: LocalVLLMEngine, loop: Any, worker: RLWorker, lora_name: str | None = None) -> float:
    async def engine_logprobs() -> list[list[float]]:
        from skylift.inference.types import TEACHER_FORCING, teacher_forced_logprobs

        outputs = await engine.generate(SEQUENCES, TEACHER_FORCING, prompt_logprobs=True, lora_name=lora_name)
        return teacher_forced_logprobs(engine.name, outputs)

    got = loop.run(engine_logprobs())
    return max(
        abs(a - b)
        for seq, lps in zip(SEQUENCES, got, strict=True)
        for a, b in zip(lps, trainer_logprobs(worker, seq), strict=True)
    )


def test_in_memory_sync_sends_only_the_adapter(
    lora_engine: LocalVLLMEngine, loop: Any, policy: RLWorker
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


def test_directory_sync(lora_engine: LocalVLLMEngine, loop: Any, policy: RLWorker, tmp_path: Path) -> None:
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
        loop.run(lora_engine.load_lora_adapter("x", str(tmp_path / "missing")))
    current = lora_engine.lora.default
    assert current is not None
    with pytest.raises(EngineRequestError, match="already been loaded"):
        loop.run(lora_engine.load_lora_adapter(current, str(tmp_path)))
    with pytest.raises(LoraAdapterNotFoundError, match="cannot be found"):
        loop.run(lora_engine.unload_lora_adapter("never-loaded"))


def test_ray_engine_actor_forwards_the_lora_calls(lora_engine: LocalVLLMEngine, loop: Any) -> None:
    """What a Ray engine actor runs for the sender's LoRA calls (the actor class, without Ray)."""
    actor = EngineActor()
    actor.engine = lora_engine
    with pytest.raises(LoraAdapterNotFoundError):
        loop.run(actor.call("unload_lora_adapter", "never-loaded"))
    for method in ("load_lora_adapter", "unload_lora_adapter", "receive_lora_adapter"):
        assert callable(getattr(lora_engine, method))
