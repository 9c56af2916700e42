"""`SharedTensorsTransport` against the IPC worker receiver over a fake worker (no vLLM): full
weights arrive whole, a push into kept buffers is streamed bucket by bucket through the shared
counter, and a sender that fails mid-fill ends the engine call instead of leaving it waiting."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from skylift.weight_sync.engine_side import WeightState
from skylift.weight_sync.ipc.engine import IpcEngineSide
from skylift.weight_sync.ipc.receiver import IpcWorkerReceiver
from skylift.weight_sync.ipc.transport import SharedTensorsTransport
from skylift.weight_sync.process_group import WeightSyncError
from skylift.weight_sync.protocol import RPC_WORKER_CALL


class Loader:
    def __init__(self, model: dict[str, torch.Tensor], log: list[tuple]) -> None:
        self.model, self.log = model, log

    def plan(self, bucket: Any) -> list[str]:
        return list(bucket.names)

    def load(self, loads: list[str], named: list[tuple[str, torch.Tensor]]) -> None:
        for name, t in named:
            self.model[name] = t.clone()
        self.log.append(("loaded", tuple(loads)))


class Worker:
    """The loading helpers `broadcast.receiver` gives the vLLM worker."""

    def __init__(self) -> None:
        self.model: dict[str, torch.Tensor] = {}
        self.log: list[tuple] = []
        self.loader = Loader(self.model, self.log)

    def _skylift_check_whole_units(self, names: list[str]) -> None:
        pass

    def _skylift_direct_loader(self) -> Loader:
        return self.loader

    @contextlib.contextmanager
    def _skylift_loading(self) -> Iterator[None]:
        yield

    def _skylift_reset_runner_caches(self) -> None:
        self.log.append(("reset",))


class Host:
    """What `IpcEngineSide` uses of its engine: one worker, reached as vLLM's collective_rpc would
    (in a thread), through the workers' generic weight call."""

    name, model_path, update_timeout_s, control_timeout_s, lora_registry = "fake", None, 30.0, 5.0, None

    def __init__(self, receiver: IpcWorkerReceiver) -> None:
        self.receiver = receiver

    async def rpc(self, operation: str, method: str, args: tuple, timeout_s: float) -> list[Any]:
        assert method == RPC_WORKER_CALL and args[0] == "ipc"
        return [await asyncio.to_thread(getattr(self.receiver, args[1]), *args[2:])]

    async def try_reset_prefix_cache(self) -> bool:
        return True


class Engine:
    """An engine whose engine side is the real `IpcEngineSide` and whose one worker runs the IPC
    receiver (in a thread, as vLLM's would run it)."""

    def __init__(self) -> None:
        self.worker = Worker()
        self.receiver = IpcWorkerReceiver(self.worker)
        self.side = IpcEngineSide(Host(self.receiver), WeightState())  # type: ignore[arg-type]
        self.payloads: list[dict[str, Any]] = []
        self.errors: list[BaseException] = []

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any]) -> Any:
        assert transport == "ipc"
        if operation == "load":
            self.payloads.append(payload)
        try:
            return await self.side.call(operation, payload)
        except Exception as exc:
            self.errors.append(exc)
            raise


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.w": torch.randn(64, 64, generator=g) for i in range(6)}


def test_pushes_arrive_whole_and_kept_buffers_are_streamed_by_bucket() -> None:
    engine = Engine()
    transport = SharedTensorsTransport(
        [engine], keep_buffers=True, bucket_bytes=2 * 64 * 64 * 4
    )  # two tensors a bucket

    async def run() -> None:
        for version, seed in enumerate((1, 2, 3), start=1):
            transport.put(weights(seed))
            await transport.push(version)
            assert all(torch.equal(engine.worker.model[k], v) for k, v in weights(seed).items())
        assert engine.receiver._open is not None  # the kept buffers stay mapped between pushes
        await transport.close()
        assert engine.receiver._open is None and engine.receiver._ready is None  # until the sender closes

    asyncio.run(run())
    first, second, third = engine.payloads
    assert first["buckets"] == [
        ["layers.0.w", "layers.1.w"],
        ["layers.2.w", "layers.3.w"],
        ["layers.4.w", "layers.5.w"],
    ]
    assert second["handle"] == first["handle"] == third["handle"]  # the kept buffers, refilled
    loads = [e for e in engine.worker.log if e[0] == "loaded"]
    assert len(loads) == 9 and transport.version == 3


def test_a_sender_failing_mid_fill_ends_the_engine_call() -> None:
    engine = Engine()
    transport = SharedTensorsTransport([engine], keep_buffers=True, bucket_bytes=2 * 64 * 64 * 4)

    async def run() -> None:
        transport.put(weights(1))
        await transport.push(1)
        bad = weights(2)
        transport.put(bad)
        original = transport._fill

        def failing(handle: Any, buckets: Any, counter: torch.Tensor) -> None:
            buckets[1] = {"layers.2.w": object()}  # copying it fails after bucket 0 is in
            original(handle, buckets, counter)

        transport._fill = failing  # type: ignore[method-assign]
        with pytest.raises(AttributeError):  # the copy's own error, raised by the push
            await asyncio.wait_for(transport.push(2), 30)
        transport._fill = original  # type: ignore[method-assign]
        transport.put(weights(3))
        await transport.push(3)  # the next push works
        assert all(torch.equal(engine.worker.model[k], v) for k, v in weights(3).items())
        await transport.close()

    asyncio.run(run())
    assert any("sender failed" in str(e) for e in engine.errors), engine.errors


def test_the_workers_wait_for_a_slow_fill_bucket_by_bucket() -> None:
    """The fill counter reaches the workers through the engine side: a worker that loaded the kept
    buffers without waiting for it would load the previous push's weights (the bug that failed
    the kept-buffer integration run: the engine side dropped `ready` and `buckets`)."""
    engine = Engine()
    transport = SharedTensorsTransport([engine], keep_buffers=True, bucket_bytes=2 * 64 * 64 * 4)
    original = transport._fill

    def slow(handle: Any, buckets: Any, counter: torch.Tensor) -> None:
        time.sleep(0.3)  # the workers are called before the first bucket is in
        original(handle, buckets, counter)

    async def run() -> None:
        transport.put(weights(1))
        await transport.push(1)
        transport._fill = slow  # type: ignore[method-assign]
        transport.put(weights(2))
        await transport.push(2)
        await transport.close()

    asyncio.run(run())
    assert all(torch.equal(engine.worker.model[k], v) for k, v in weights(2).items())


def test_an_engine_failure_is_a_weight_sync_error() -> None:
    class Broken(Engine):
        async def weight_call(self, transport: str, operation: str, payload: dict[str, Any]) -> Any:
            raise RuntimeError("engine gone")

    transport = SharedTensorsTransport([Broken()])
    transport.put(weights(1))
    with pytest.raises(WeightSyncError, match="shared-tensor weight sync: engine gone"):
        asyncio.run(transport.push(1))
