"""A training run's full-weight transport chosen from where the ranks say they run
(`weight_sync.placed`), and the policy's shared-memory path (`ipc.policy_rank` +
`ipc.policy_transport`) against the real IPC engine side and worker receiver over a fake worker
(no vLLM; the real engine: tests/integration/test_weight_sync_shm.py)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from test_ipc_transport import Engine, weights

from skylift.weight_sync.ipc.place import place_from_wire, place_of
from skylift.weight_sync.ipc.policy_rank import SharedWeightsRank
from skylift.weight_sync.ipc.policy_transport import PolicySharedTransport
from skylift.weight_sync.placed import PlacedTransport, resolve
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.topology import Place

A, B = "node-a", "node-b"
CPU_A, CPU_B = Place(A), Place(B)
GPU0, GPU1 = Place(A, "cuda", "GPU-0"), Place(A, "cuda", "GPU-1")


def test_auto_picks_from_the_places() -> None:
    assert resolve("auto", CPU_A, [[CPU_A], [CPU_A]])[0] == "ipc"  # shared memory on one host
    assert resolve("ipc", CPU_A, [[CPU_A], [CPU_A]])[0] == "ipc"
    assert resolve("auto", CPU_A, [[CPU_B]])[0] == "gloo"
    assert resolve("auto", GPU0, [[GPU0]])[0] == "ipc"  # CUDA IPC: NCCL refuses the pair
    assert resolve("auto", GPU0, [[GPU1], [Place(B, "cuda", "GPU-9")]])[0] == "nccl"
    assert resolve("auto", GPU0, [[GPU1, GPU0]])[0] == "ipc"  # a TP engine with a worker on rank 0's GPU
    chosen, why = resolve("auto", GPU0, [[GPU0], [GPU1]])  # one engine needs IPC, one NCCL
    assert chosen == "gloo" and "ipc and nccl" in why


def test_a_forced_backend_is_checked_against_the_places() -> None:
    assert resolve("gloo", GPU0, [[GPU0]]) == ("gloo", "forced by generator.weight_sync_backend")
    with pytest.raises(WeightSyncError, match="weight_sync_backend=nccl cannot work: .* share GPU GPU-0"):
        resolve("nccl", GPU0, [[GPU1], [GPU0]])
    with pytest.raises(
        WeightSyncError, match="weight_sync_backend=ipc cannot work: engine 0's worker 0 runs on node-b"
    ):
        resolve("ipc", CPU_A, [[CPU_B]])


def test_a_place_round_trips_and_bad_ones_are_refused() -> None:
    here = place_from_wire(place_of(None))
    assert here.device == "cpu" and here.gpu is None
    assert place_from_wire({"host": A, "device": "cuda", "gpu": "GPU-0"}) == GPU0
    for bad in ({"host": A, "device": "tpu"}, {"device": "cpu"}, {"host": A, "device": "cuda"}):
        with pytest.raises(ValueError):
            place_from_wire(bad)


class Rank(SharedWeightsRank):
    """A policy rank: its weights (rank 0's are what the engines get) and the gathers it ran."""

    def __init__(self, rank: int, state: dict[str, torch.Tensor]) -> None:
        self.rank, self.device, self.state, self.gathers = rank, torch.device("cpu"), state, 0
        self.yielded = 0

    def engine_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        self.gathers += 1
        for item in self.state.items():
            self.yielded += 1  # a gather of one tensor: every rank must take part in each
            yield item


class Policy:
    """`WorkerGroup.call_rank0` / `call_all` over in-process ranks."""

    def __init__(self, ranks: list[Rank]) -> None:
        self.ranks = ranks

    def call_rank0(self, method: Any, *args: Any) -> Any:
        return method(self.ranks[0], *args)

    def call_all(self, method: Any, *args: Any) -> list[Any]:
        return [method(r, *args) for r in self.ranks]


class Engines:
    """An `EngineSet` of fake engines whose weight calls reach the real IPC engine side."""

    def __init__(self, engines: list[Engine]) -> None:
        self.engines = engines
        self.live_indices = list(range(len(engines)))

    async def probe(self, timeout_s: float = 10.0) -> list[int]:
        return self.live_indices

    async def weight_call(
        self, transport: str, operation: str, payload: Any = None, *, strict: bool = True
    ) -> list[Any]:
        if operation == "places":
            return [[place_of(None)] for _ in self.engines]
        return list(
            await asyncio.gather(*(e.weight_call(transport, operation, payload) for e in self.engines))
        )


def test_the_policy_shares_new_buffers_first_then_streams_into_the_kept_ones() -> None:
    ranks = [Rank(0, weights(1)), Rank(1, {})]
    engines = Engines([Engine(), Engine()])
    transport = PolicySharedTransport(Policy(ranks), engines, print, bucket_bytes=2 * 64 * 64 * 4)

    async def run() -> list[dict[str, float]]:
        out = []
        for seed in (1, 2, 3):
            ranks[0].state = weights(seed)
            out.append(await transport.push(seed))
            for engine in engines.engines:
                assert all(torch.equal(engine.worker.model[k], v) for k, v in weights(seed).items())
        await transport.close()
        return out

    metrics = asyncio.run(run())
    assert [m["weight_sync/streamed"] for m in metrics] == [0.0, 1.0, 1.0]
    assert all(m["weight_sync/bytes"] == 6 * 64 * 64 * 4 for m in metrics)
    assert [r.gathers for r in ranks] == [3, 3]  # every rank gathers each push (a collective)
    first, second, third = engines.engines[0].payloads
    assert "ready" not in first and second["handle"] == third["handle"] == first["handle"]
    assert second["buckets"] == [[f"layers.{i}.w", f"layers.{i + 1}.w"] for i in (0, 2, 4)]
    assert ranks[0].__dict__["_skylift_shared_sender"].kept is None  # close released them
    # and the engines' workers dropped the views they kept (a server would hold them until its next load)
    assert all(e.receiver._open is None and e.receiver._ready is None for e in engines.engines)


class LaidOutRank(Rank):
    """A rank that knows its weights' layout before gathering (`RLWorker.engine_weight_layout`)."""

    def engine_weight_layout(self) -> list[tuple[str, torch.Tensor]]:
        return [(k, torch.empty(v.shape, dtype=v.dtype, device="meta")) for k, v in self.state.items()]


def test_a_known_layout_streams_the_first_push_too_in_the_engines_dtype() -> None:
    ranks = [LaidOutRank(0, weights(1)), LaidOutRank(1, {})]
    engines = Engines([Engine()])
    transport = PolicySharedTransport(
        Policy(ranks), engines, print, dtype="bfloat16", bucket_bytes=2 * 64 * 64 * 2
    )

    async def run() -> list[dict[str, float]]:
        out = []
        for seed in (1, 2):
            ranks[0].state = weights(seed)
            out.append(await transport.push(seed))
            for k, v in weights(seed).items():
                assert torch.equal(engines.engines[0].worker.model[k], v.to(torch.bfloat16)), k
        await transport.close()
        return out

    metrics = asyncio.run(run())
    # no whole gathered copy on rank 0: buffers laid out first, filled as the gather yields
    assert [m["weight_sync/streamed"] for m in metrics] == [1.0, 1.0]
    assert all(m["weight_sync/bytes"] == 6 * 64 * 64 * 2 for m in metrics)
    first, second = engines.engines[0].payloads
    assert first["handle"] == second["handle"] and first["buckets"] == second["buckets"]
    assert [r.gathers for r in ranks] == [2, 2]


def test_another_layout_stops_the_workers_and_the_gathers_complete() -> None:
    ranks = [Rank(0, weights(1)), Rank(1, {})]
    engine = Engine()
    transport = PolicySharedTransport(Policy(ranks), Engines([engine]), print, bucket_bytes=2 * 64 * 64 * 4)

    async def run() -> None:
        await transport.push(1)
        ranks[0].state = {**weights(2), "layers.2.w": torch.zeros(3)}  # another shape
        with pytest.raises(WeightSyncError, match="'layers.2.w' \\(3,\\) does not fit the kept buffers"):
            await transport.push(2)
        await transport.close()

    asyncio.run(run())
    assert any("sender failed" in str(e) for e in engine.errors), engine.errors
    assert ranks[0].yielded == 12  # rank 0 drained its gather: no other rank is left waiting in one


def test_new_buffers_each_push_are_freed_once_loaded() -> None:
    ranks = [Rank(0, weights(1))]
    engine = Engine()
    transport = PolicySharedTransport(Policy(ranks), Engines([engine]), print, keep_buffers=False)
    asyncio.run(transport.push(1))
    sender = ranks[0].__dict__["_skylift_shared_sender"]
    assert sender.kept is None and sender.fresh is None
    assert all(torch.equal(engine.worker.model[k], v) for k, v in weights(1).items())


def test_placed_transport_opens_what_the_places_call_for() -> None:
    ranks = [Rank(0, weights(1))]
    engines = Engines([Engine()])
    built: list[str | None] = []

    def build(choice: str | None, served: Any) -> Any:
        assert served is engines
        built.append(choice)
        return PolicySharedTransport(Policy(ranks), engines, print)

    placed = PlacedTransport("ipc", Policy(ranks), engines, print, build)
    line = asyncio.run(placed.open())
    assert built == ["ipc"] and "[ipc: forced by generator.weight_sync_backend]" in line
    with pytest.raises(
        WeightSyncError, match="weight_sync_backend=nccl cannot work: the trainer's rank 0 runs on CPU"
    ):
        asyncio.run(PlacedTransport("nccl", Policy(ranks), engines, print, build).open())


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_a_workers_layout_is_what_its_gather_yields(tiny_model_dir: Any, lora_rank: int) -> None:
    """`RLWorker.engine_weight_layout` (meta tensors, nothing gathered) names, shapes and types
    what `engine_weights` yields, in its order: the kept buffers a first push fills fit it. A LoRA
    policy's: its base's, the adapter merged in."""
    from skylift.cluster.worker_group import WorkerGroup
    from skylift.worker.training_worker import WorkerSettings

    settings = WorkerSettings(model_path=str(tiny_model_dir), lora_rank=lora_rank)
    group = WorkerGroup("policy", settings, use_ray=False)
    group.setup()
    try:
        worker: Any = group.workers[0]
        layout = worker.engine_weight_layout()
        gathered = list(worker.engine_weights())
        assert all(t.device.type == "meta" for _, t in layout)
        assert [(n, t.shape, t.dtype) for n, t in layout] == [(n, t.shape, t.dtype) for n, t in gathered]
        assert not any("lora_" in n or "base_layer" in n for n, _ in layout)
    finally:
        group.shutdown()


class Opened:
    """A built transport that only says it opened."""

    def __init__(self, choice: str | None, engines: Any) -> None:
        self.choice = choice

    async def open(self) -> str:
        return f"opened {self.choice}"


def test_auto_on_cpu_shares_memory_where_dev_shm_holds_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    from skylift.weight_sync.ipc import policy_rank

    state = weights(1)
    need = sum(t.numel() * 2 for t in state.values())  # sent as bf16
    engines = Engines([Engine()])

    def opened(free: int, rank: Rank) -> str:
        monkeypatch.setattr(policy_rank, "free_bytes", lambda: free)
        placed = PlacedTransport("auto", Policy([rank]), engines, print, Opened, dtype="bfloat16")
        return asyncio.run(placed.open())

    line = opened(need + (1 << 30), LaidOutRank(0, state))
    assert line.startswith("opened ipc [ipc: policy rank 0 on") and line.endswith("; shared memory]"), line
    line = opened(64 << 20, LaidOutRank(0, state))  # a container's default /dev/shm, mostly used
    assert line.startswith("opened gloo [gloo:") and "; /dev/shm has 64 MiB free, the weights need" in line, (
        line
    )
    line = opened(need + (1 << 30), Rank(0, state))  # layout unknown before gathering: the wire
    assert "the weights' size is not known before gathering: gloo]" in line, line


def test_a_forced_ipc_on_cpu_skips_the_room_check(monkeypatch: pytest.MonkeyPatch) -> None:
    from skylift.weight_sync.ipc import policy_rank

    monkeypatch.setattr(policy_rank, "free_bytes", lambda: 0)  # the push itself refuses, in one line
    placed = PlacedTransport("ipc", Policy([LaidOutRank(0, weights(1))]), Engines([Engine()]), print, Opened)
    assert asyncio.run(placed.open()) == "opened ipc [ipc: forced by generator.weight_sync_backend]"


class RankZeroAt:
    """A policy whose rank 0 says it runs at `place` (a GPU here: saying so needs no CUDA)."""

    def __init__(self, place: Place) -> None:
        self.place = place

    def call_rank0(self, method: Any, *args: Any) -> dict[str, Any]:
        assert method is SharedWeightsRank.weight_sync_place
        return {"host": self.place.host, "device": self.place.device, "gpu": self.place.gpu}


class PlacedEngines(Engines):
    """Engines whose workers say they run at the given places."""

    def __init__(self, places: list[list[Place]]) -> None:
        super().__init__([Engine() for _ in places])
        self.places = places

    async def weight_call(
        self, transport: str, operation: str, payload: Any = None, *, strict: bool = True
    ) -> list[Any]:
        assert operation == "places"
        return [
            [{"host": p.host, "device": p.device, "gpu": p.gpu} for p in workers] for workers in self.places
        ]


def test_a_lora_adapters_group_is_gloo_where_an_engine_shares_rank_0s_gpu_else_nccl() -> None:
    """A LoRA adapter goes over a group, and NCCL refuses a same-GPU pair: one GPU whose bundles Ray
    shares between the policy and the engine (a one-GPU LoRA run) gets gloo, engines on GPUs of
    their own get NCCL; a forced nccl onto rank 0's GPU is refused in one line."""

    def opened(backend: str, engines: list[list[Place]]) -> str:
        placed = PlacedTransport(
            backend, RankZeroAt(GPU0), PlacedEngines(engines), print, Opened, adapter=True
        )
        return asyncio.run(placed.open())

    line = opened("auto", [[GPU0]])
    assert line.startswith("opened gloo [gloo: policy rank 0 on node-a cuda GPU GPU-0") and line.endswith(
        ": a LoRA adapter goes over a gloo group there]"
    ), line
    assert opened("auto", [[GPU1]]).startswith("opened nccl [nccl: ")
    assert opened("auto", [[GPU0], [GPU1]]).startswith("opened gloo [gloo: ")  # a mix: one gloo group
    assert opened("gloo", [[GPU1]]) == "opened gloo [gloo: forced by generator.weight_sync_backend]"
    with pytest.raises(WeightSyncError, match="weight_sync_backend=nccl cannot work: .* share GPU GPU-0"):
        opened("nccl", [[GPU0]])
