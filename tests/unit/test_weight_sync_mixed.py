"""Full weights to a mix of engines (`weight_sync.mixed` behind `PlacedTransport`), each part over
its own view of the pool (`EnginePool.subset`): on CPU, an engine on the policy's host takes shared
memory and one on "another host" a gloo group, in one training run's transport
(`make_transport`). The engines are fakes whose engine halves are the real ones (`IpcEngineSide`,
`BroadcastEngineSide`) and whose one worker runs the real receivers (the IPC receiver and vLLM's
weight-sync extension, loading into a dict); the policy's rank 0 runs `RLWorker`'s own group
methods over a real gloo group on 127.0.0.1. Only the remote engine's place is made up."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from server_helpers import require_loopback_namespace
from test_ipc_transport import Worker, weights
from test_weight_sync_placed import GPU0, GPU1, LaidOutRank, Opened, PlacedEngines, RankZeroAt

from skylift.cluster.worker_group import RLWorker
from skylift.config import load_config
from skylift.inference.pool import EnginePool, NoHealthyEngineError
from skylift.inference.types import EngineUnavailableError
from skylift.weight_sync.broadcast.receiver import WeightSyncWorkerExtension
from skylift.weight_sync.factory import make_engine_sides, make_transport
from skylift.weight_sync.ipc.receiver import IpcWorkerReceiver
from skylift.weight_sync.placed import PlacedTransport
from skylift.weight_sync.protocol import RPC_WORKER_CALL


class FakeWorker(Worker, WeightSyncWorkerExtension):
    """A vLLM worker: the broadcast receiver (vLLM's weight-sync extension) loading into a dict
    through the fake loader, and the IPC receiver beside it."""

    rank = 0

    def __init__(self) -> None:
        super().__init__()
        self.ipc = IpcWorkerReceiver(self)


class Host:
    """What the engine halves use of their engine: one worker, called in a thread as vLLM's
    collective_rpc would."""

    model_path, update_timeout_s, control_timeout_s, lora_registry, workers = None, 30.0, 5.0, None, 1

    def __init__(self, name: str, worker: FakeWorker) -> None:
        self.name, self.worker = name, worker

    async def rpc(self, operation: str, method: str, args: tuple, timeout_s: float) -> list[Any]:
        if method == RPC_WORKER_CALL:
            assert args[0] == "ipc"
            return [await asyncio.to_thread(getattr(self.worker.ipc, args[1]), *args[2:])]
        return [await asyncio.to_thread(getattr(self.worker, method), *args)]

    async def try_reset_prefix_cache(self) -> bool:
        return True


class Engine:
    """One engine of the pool: its weight calls reach the real engine halves; `remote` says its
    worker runs on another host; a dead one fails every call as an engine that is gone."""

    def __init__(self, name: str, remote: bool = False) -> None:
        self.name, self.remote, self.dead = name, remote, False
        self.worker = FakeWorker()
        self.sides = make_engine_sides(Host(name, self.worker))  # type: ignore[arg-type]
        self.calls: list[tuple[str, str]] = []

    def __repr__(self) -> str:
        return self.name

    def _check(self) -> None:
        if self.dead:
            raise EngineUnavailableError(f"{self.name} is gone")

    async def tensor_parallel_size(self) -> int:
        self._check()
        return 1

    async def health(self) -> bool:
        return not self.dead

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        self._check()
        self.calls.append((transport, operation))
        if (transport, operation) == ("ipc", "places") and self.remote:
            return [{"host": "another-host", "device": "cpu", "gpu": None}]
        return await self.sides.call(transport, operation, payload)


class Rank(LaidOutRank):
    """The policy's one rank: the shared-memory path's rank 0 and `RLWorker`'s group methods."""

    broadcaster = None
    host_weight_group = RLWorker.host_weight_group
    join_weight_group = RLWorker.join_weight_group
    broadcast_weights = RLWorker.broadcast_weights
    close_weight_group = RLWorker.close_weight_group
    _require_broadcaster = RLWorker._require_broadcaster

    def node_ip(self) -> str:
        return "127.0.0.1"


class Policy:
    """`WorkerGroup` over one in-process rank: `call_rank0` / `call_all` and the group's calls."""

    def __init__(self, rank: Rank) -> None:
        self.rank = rank

    def call_rank0(self, method: Any, *args: Any) -> Any:
        return method(self.rank, *args)

    def call_all(self, method: Any, *args: Any) -> list[Any]:
        return [method(self.rank, *args)]

    def host_weight_group(self, *args: Any) -> tuple[str, int, str]:
        return self.rank.host_weight_group(*args)

    def join_weight_group(self) -> None:
        self.rank.join_weight_group()

    def broadcast_weights(self, dtype: str | None) -> dict[str, float]:
        return self.rank.broadcast_weights(dtype=dtype)

    def close_weight_group(self) -> None:
        self.rank.close_weight_group()


def holds(engine: Engine, seed: int) -> bool:
    model = engine.worker.model
    return set(model) == set(weights(seed)) and all(
        torch.equal(model[k], v) for k, v in weights(seed).items()
    )


def mixed_run(dead: str | None) -> tuple[list[str], list[dict[str, float]], Engine, Engine, EnginePool]:
    """Open the run's transport over a same-host engine and a remote one, push versions 1 and 2,
    then (`dead`: "local" / "remote") lose that engine and push version 3; close."""
    require_loopback_namespace()  # gloo listens on every interface
    here, there = Engine("here"), Engine("there", remote=True)
    pool = EnginePool([here, there])  # type: ignore[list-item]
    rank = Rank(0, weights(1))
    said: list[str] = []
    cfg = load_config(["generator.weight_sync_timeout_s=30"])
    transport = make_transport(cfg, Policy(rank), pool, said.append)
    figures = []

    async def run() -> None:
        said.append(await transport.open())
        for seed in (1, 2):
            rank.state = weights(seed)
            figures.append(await transport.push(seed))
            assert holds(here, seed) and holds(there, seed), seed
        if dead is not None:
            (here if dead == "local" else there).dead = True
            rank.state = weights(3)
            figures.append(await transport.push(3))
        await transport.close()

    asyncio.run(run())
    return said, figures, here, there, pool


def test_a_same_host_engine_takes_shared_memory_and_a_remote_one_a_gloo_group() -> None:
    said, figures, here, there, pool = mixed_run(None)
    line = said[0]
    assert line.startswith(
        "weight sync, each engine its own way: engine(s) [0]: weight sync: 1 engine(s) on the "
    ), line
    assert "; engine(s) [1]: weight sync: 1 engine(s) dial 127.0.0.1" in line, line
    assert line.endswith(
        ": engines need ipc and gloo; shared memory: ipc for engine(s) [0], one gloo group for engine(s) [1]]"
    )
    assert "[ipc+gloo: policy rank 0 on " in line
    # each engine was only ever addressed by its own part (and asked its place, by the pool)
    assert {t for t, _ in here.calls} == {"ipc"} and set(here.calls) >= {("ipc", "load"), ("ipc", "release")}
    assert set(there.calls) == {
        ("ipc", "places"),
        ("broadcast", "join"),
        ("broadcast", "stream"),
        ("broadcast", "leave"),
    }
    nbytes = sum(t.numel() * 4 for t in weights(1).values())
    for f in figures:  # each part's figures under its name, the bytes of both together
        assert f["weight_sync/ipc/bytes"] == f["weight_sync/gloo/bytes"] == nbytes
        assert f["weight_sync/bytes"] == 2 * nbytes and f["timing/weight_sync_s"] > 0
    assert figures[1]["weight_sync/ipc/streamed"] == 1.0  # the kept buffers, refilled
    assert pool.live_indices == [0, 1] and not pool.failures


def test_an_engine_lost_in_one_part_leaves_the_pool_and_the_other_part_goes_on() -> None:
    # the shared-memory engine fails its load: the pool takes it out, the gloo engine still loads
    said, figures, here, there, pool = mixed_run("local")
    assert pool.live_indices == [1] and "here is gone" in pool.failures[0]
    assert holds(there, 3) and holds(here, 2)
    assert figures[-1]["weight_sync/gloo/bytes"] > 0 and "weight_sync/ipc/bytes" not in figures[-1]
    assert any(
        s.startswith(
            "weight sync: ipc engines [0] loaded nothing: no healthy inference engine left among engines [0]"
        )
        for s in said
    ), said
    # the remote engine fails its stream: the gloo part's retry probes it out of the pool and its
    # group is left; the shared-memory engine loads version 3
    said, figures, here, there, pool = mixed_run("remote")
    assert pool.live_indices == [0] and 1 in pool.failures
    assert holds(here, 3) and holds(there, 2)
    assert figures[-1]["weight_sync/ipc/bytes"] > 0


def test_a_subset_calls_only_its_engines_and_marks_failures_in_the_pool() -> None:
    engines = [Engine(f"e{i}") for i in range(3)]
    pool = EnginePool(engines)  # type: ignore[list-item]
    view = pool.subset([2, 0])
    assert view.engines == [engines[2], engines[0]] and view.live_indices == [0, 1]
    asyncio.run(view.weight_call("ipc", "places", {}))
    assert [bool(e.calls) for e in engines] == [True, False, True]
    engines[2].dead = True
    assert asyncio.run(view.probe()) == [1] and pool.live_indices == [0, 1] and 2 in pool.failures
    engines[0].dead = True
    with pytest.raises(
        NoHealthyEngineError, match=r"among engines \[0, 2\] of the pool \(1 live elsewhere\)"
    ):
        asyncio.run(view.weight_call("ipc", "places", {}, strict=False))
    assert pool.live_indices == [1] and not engines[1].calls
    with pytest.raises(ValueError, match="not all in a pool of 3"):
        pool.subset([3])


class AtGpu(Engine):
    """An engine whose one worker says it runs on `gpu` of node-a (saying so needs no CUDA)."""

    def __init__(self, name: str, gpu: str) -> None:
        super().__init__(name)
        self.gpu = gpu

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        assert (transport, operation) == ("ipc", "places")
        return [{"host": "node-a", "device": "cuda", "gpu": self.gpu}]


def test_colocate_all_on_several_gpus_takes_cuda_ipc_and_one_nccl_group() -> None:
    """The GPU layout of ``colocate_all`` (engine 0 on rank 0's GPU, engines 1 and 2 on GPUs of
    their own) opens IPC for engine 0 and one NCCL group for the others, each over its engines;
    a forced backend and an engine set that cannot be split keep one transport for all."""
    engines = [AtGpu("e0", "GPU-0"), AtGpu("e1", "GPU-1"), AtGpu("e2", "GPU-2")]
    pool = EnginePool(engines)  # type: ignore[list-item]
    built: list[tuple[str | None, list[Any]]] = []

    def build(choice: str | None, served: Any) -> Opened:
        built.append((choice, list(served.engines)))
        return Opened(choice, served)

    placed = PlacedTransport("auto", RankZeroAt(GPU0), pool, print, build)
    line = asyncio.run(placed.open())
    assert built == [("ipc", [engines[0]]), ("nccl", engines[1:])]
    assert line.startswith(
        "weight sync, each engine its own way: engine(s) [0]: opened ipc; engine(s) [1, 2]: opened nccl "
    )
    assert line.endswith(
        ": engines need ipc and nccl: ipc for engine(s) [0], one nccl group for engine(s) [1, 2]]"
    )
    assert placed.name == "ipc+nccl"
    built.clear()
    assert asyncio.run(PlacedTransport("gloo", RankZeroAt(GPU0), pool, print, build).open()).startswith(
        "opened gloo [gloo: forced"
    )
    assert built == [("gloo", engines)]
    unsplittable = PlacedEngines([[GPU0], [GPU1]])  # an engine set without `subset`
    line = asyncio.run(PlacedTransport("auto", RankZeroAt(GPU0), unsplittable, print, Opened).open())
    assert line.startswith("opened gloo [gloo: ") and line.endswith(
        "this engine set cannot be split, one gloo group carries both]"
    )
