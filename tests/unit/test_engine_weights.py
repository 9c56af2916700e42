"""The driver's half of weight sync (`EngineWeights` over `PolicySync` and `EngineGroup`) with fake
engines and a fake policy: who is told what, in which order, and how engine loss reshapes the
group. The broadcast itself (gloo, vLLM) runs in tests/integration (test_weight_sync_local.py,
test_lora_sync.py, test_async_training.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest

from skylift.cluster.engine_weights import EngineWeights
from skylift.config import load_config
from skylift.inference.pool import EnginePool
from skylift.inference.types import EngineUnavailableError
from skylift.weight_sync.lora.adapter import LoraAdapterSpec
from skylift.weight_sync.protocol import WeightBucket, WeightUpdateGroupSpec


class Engine:
    """An engine's weight-sync calls, recorded; a dead one fails them all."""

    def __init__(self, name: str, log: list[tuple]) -> None:
        self.name, self.log, self.dead = name, log, False

    def __repr__(self) -> str:
        return self.name

    def _check(self) -> None:
        if self.dead:
            raise EngineUnavailableError(f"{self.name} is gone")

    async def tensor_parallel_size(self) -> int:
        self._check()
        return 2 if self.name == "e1" else 1

    async def init_weight_update_communicator(self, spec: WeightUpdateGroupSpec) -> None:
        self._check()
        self.log.append((self.name, "join", spec.rank_offset, spec.world_size, spec.override_existing))

    async def receive_weight_stream(self) -> dict[str, Any]:
        self._check()
        self.log.append((self.name, "receive"))
        return {}

    async def destroy_weights_update_group(self) -> None:
        self._check()
        self.log.append((self.name, "leave"))

    async def health(self) -> bool:
        return not self.dead

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        """The one generic weight call (`weight_sync.engine_side`) onto the recorded methods above."""
        payload = payload or {}
        if (transport, operation) == ("ipc", "places"):  # where its workers run: another host's CPU
            self._check()
            return [
                {"host": f"{self.name}-host", "device": "cpu", "gpu": None}
            ] * await self.tensor_parallel_size()
        if (transport, operation) == ("broadcast", "join"):
            return await self.init_weight_update_communicator(WeightUpdateGroupSpec(**payload))
        if (transport, operation) == ("broadcast", "stream"):
            return await self.receive_weight_stream()
        if (transport, operation) == ("broadcast", "leave"):
            return await self.destroy_weights_update_group()
        if (transport, operation) == ("lora", "receive"):
            bucket = WeightBucket(payload.pop("names"), payload.pop("dtypes"), payload.pop("shapes"))
            return await self.receive_lora_adapter(bucket, LoraAdapterSpec(**payload))  # type: ignore[attr-defined]
        if (transport, operation) == ("lora", "load"):
            load = self.load_lora_adapter  # type: ignore[attr-defined]
            return await load(payload["lora_name"], payload["lora_path"], activate=payload["activate"])
        if (transport, operation) == ("lora", "unload"):
            return await self.unload_lora_adapter(payload["lora_name"])  # type: ignore[attr-defined]
        raise AssertionError(f"unexpected weight call {transport}.{operation}")


class Policy:
    """The policy's side (`WorkerGroup`'s weight-sync methods, which run in the policy's ranks), recorded."""

    def __init__(self, log: list[tuple]) -> None:
        self.log = log

    def call_rank0(self, method: Any, *args: Any) -> Any:
        """`WorkerGroup.call_rank0`: only rank 0's place is asked of the fake (a CPU host of its own)."""
        assert method.__name__ == "weight_sync_place"
        return {"host": "trainer-host", "device": "cpu", "gpu": None}

    def host_weight_group(self, world_size: int, *how: Any) -> tuple[str, int, str]:
        self.log.append(("policy", "host", world_size))
        return "10.0.0.7", 4242, "gloo"

    def join_weight_group(self) -> None:
        self.log.append(("policy", "join"))

    def broadcast_weights(self, dtype: str | None) -> dict[str, float]:
        self.log.append(("policy", "broadcast", dtype))
        return {"weight_sync/bytes": 8.0}

    def stage_lora_adapter(self, dtype: str | None) -> tuple[WeightBucket, dict[str, Any]]:
        raise AssertionError("a full-weights policy stages no adapter")

    def broadcast_lora_adapter(self) -> int:
        raise AssertionError("a full-weights policy broadcasts no adapter")

    def write_lora_adapter(self, directory: str, dtype: str | None) -> tuple[int, int]:
        raise AssertionError("a full-weights policy writes no adapter")

    def close_weight_group(self) -> None:
        self.log.append(("policy", "close"))


@pytest.fixture
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def test_the_driver_tells_the_pools_live_engines_to_receive(loop: asyncio.AbstractEventLoop) -> None:
    log: list[tuple] = []
    said: list[str] = []
    engines = [Engine("e0", log), Engine("e1", log)]
    pool = EnginePool(engines)  # type: ignore[list-item]
    cfg = load_config(["generator.model_dtype=bfloat16"])
    weights = EngineWeights(cfg, Policy(log), pool, loop.run_until_complete, said.append)  # type: ignore[arg-type]

    weights.open()
    # rank 0 hosts for 1 + 1 + 2 ranks; the engines join at their offsets while rank 0 joins
    assert log[0] == ("policy", "host", 4)
    # the engines' workers run on other hosts than rank 0: a gloo group (weight_sync.placed)
    assert said == [
        "weight sync: 2 engine(s) dial 10.0.0.7 [gloo: policy rank 0 on trainer-host cpu; engines on "
        "e0-host cpu, e1-host cpu]"
    ]
    broadcast = weights.transport.inner  # type: ignore[attr-defined]
    keep = broadcast.override_existing  # generator.override_existing_update_group
    assert sorted(log[1:]) == [("e0", "join", 1, 4, keep), ("e1", "join", 2, 4, keep), ("policy", "join")]

    log.clear()
    figures = weights.sync(1)
    assert sorted(log) == [("e0", "receive"), ("e1", "receive"), ("policy", "broadcast", "bfloat16")]
    assert weights.version == 1
    # the push's figures, for the step's metrics (rank 0's bytes, the push's time, the transport)
    assert figures["weight_sync/bytes"] == 8.0 and figures["weight_sync/via/gloo"] == 1.0
    assert figures["timing/weight_sync_push_s"] >= 0 and "timing/weight_sync_s" not in figures

    # engine 1 dies: the broadcast fails, the pool's probe takes it out, the group is rebuilt over
    # engine 0 alone (its membership replaced) and the sync retried once
    engines[1].dead = True
    log.clear()
    weights.sync(2)
    assert pool.live_indices == [0] and 1 in pool.failures
    tail = log[log.index(("e0", "leave")) :]
    assert tail[:3] == [("e0", "leave"), ("policy", "close"), ("policy", "host", 2)]  # engines leave first
    assert sorted(tail[3:5]) == [("e0", "join", 1, 2, True), ("policy", "join")]
    assert sorted(tail[5:]) == [("e0", "receive"), ("policy", "broadcast", "bfloat16")]
    assert said[-2:] == [
        "weight sync failed (engine 1 (e1): receive_weight_stream failed: e1 is gone); checking the "
        "engines and retrying once",
        "rebuilding the weight-update group with 1 live engine(s) of 2",
    ]
    assert broadcast.members == [engines[0]] and weights.version == 2

    # nothing changed since: no new group
    log.clear()
    weights.sync(3)
    assert sorted(log) == [("e0", "receive"), ("policy", "broadcast", "bfloat16")]

    # the pool takes the last engine out: the group is destroyed and nothing is sent
    pool.mark_failed(0, "test")
    log.clear()
    assert weights.sync(4) == {}  # nothing loaded: no figures
    assert log == [("e0", "leave"), ("policy", "close")]
    assert broadcast.members == [] and weights.version == 4


class LoraEngine(Engine):
    async def receive_lora_adapter(self, bucket: WeightBucket, adapter: Any) -> None:
        self.log.append(
            (self.name, "receive_lora", adapter.name[-2:], [r[-2:] for r in adapter.retire], bucket.names)
        )

    async def load_lora_adapter(
        self, name: str, path: str, *, load_inplace: bool = False, activate: bool = False
    ) -> None:
        self.log.append((self.name, "load_lora", name[-2:], path.endswith(name), activate))

    async def unload_lora_adapter(self, name: str) -> None:
        self.log.append((self.name, "unload_lora", name[-2:]))


class LoraPolicyRanks(Policy):
    def stage_lora_adapter(self, dtype: str | None) -> tuple[WeightBucket, dict[str, Any]]:
        self.log.append(("policy", "stage", dtype))
        return WeightBucket(["a.lora_A.weight"], ["float32"], [[2, 4]]), {"r": 2}

    def broadcast_lora_adapter(self) -> int:
        self.log.append(("policy", "broadcast_lora"))
        return 32

    def write_lora_adapter(self, directory: str, dtype: str | None) -> tuple[int, int]:
        self.log.append(("policy", "write", directory.rsplit("-", 1)[-1]))
        return 1, 32


def test_a_lora_policy_publishes_a_new_adapter_name_per_sync(
    loop: asyncio.AbstractEventLoop, tmp_path: Any
) -> None:
    from skylift.weight_sync.lora.transport import LoraPolicySync

    log: list[tuple] = []
    link = LoraPolicySync(LoraPolicyRanks(log))  # type: ignore[arg-type]
    loop.run_until_complete(link.open([LoraEngine("e0", log)]))  # type: ignore[list-item]
    log.clear()
    # in memory: staged on rank 0, then broadcast while the engine receives; the version two
    # syncs old leaves in the same engine call
    for _ in range(3):
        metrics = loop.run_until_complete(link.push("bfloat16"))
        assert metrics["weight_sync/bytes"] == 32.0
    received = [e for e in log if e[1] == "receive_lora"]
    assert received == [
        ("e0", "receive_lora", "v1", [], ["a.lora_A.weight"]),
        ("e0", "receive_lora", "v2", [], ["a.lora_A.weight"]),
        ("e0", "receive_lora", "v3", ["v1"], ["a.lora_A.weight"]),
    ]
    assert log.count(("policy", "stage", "bfloat16")) == 3 and log.count(("policy", "broadcast_lora")) == 3
    # through a directory: the superseded version is unloaded first, rank 0 writes, the engine loads
    log.clear()
    loop.run_until_complete(link.push(None, str(tmp_path)))
    assert log == [
        ("e0", "unload_lora", "v2"),
        ("policy", "write", "v4"),
        ("e0", "load_lora", "v4", True, True),
    ]
