"""`skylift serve`'s request limits, disconnect aborts and rendezvous probe, without an engine.

The routes run in a FastAPI app over `LocalVLLMEngine` wrapping a fake vLLM engine (no vLLM
process); the rendezvous probe meets a real torch TCPStore, a listener that is no store and a
closed port on loopback, and the join is driven through a fake worker RPC.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from skylift.inference import routes
from skylift.inference.disconnect import ClientDisconnected, unless_disconnected
from skylift.inference.limits import MAX_REQUEST_TOKENS, MAX_SEQUENCES, SEED_MAX, SEED_MIN
from skylift.inference.local import LocalVLLMEngine
from skylift.inference.types import EngineError, EngineRequestError, WeightUpdateGroupSpec
from skylift.weight_sync.broadcast.rendezvous import join_rpc_timeout_s, join_weight_update_group, probe_store
from skylift.weight_sync.process_group import announce_ranks

MAX_MODEL_LEN = 1 << 20  # large, so that the request limits, not the context, bind


class FakeVllm:
    """What `LocalVLLMEngine.generate` uses of vLLM's AsyncLLM: a stream per request, abort."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.started: list[str] = []
        self.aborted: list[str] = []
        self.prompts: list[dict[str, Any]] = []  # each prompt as vLLM got it

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> AsyncIterator[Any]:
        self.started.append(request_id)
        self.prompts.append(prompt)
        await asyncio.sleep(self.step_s)
        outputs = [
            SimpleNamespace(
                index=i, token_ids=[1], logprobs=None, finish_reason="length", stop_reason=None, text=""
            )
            for i in range(params.n)
        ]
        ids = prompt["prompt_token_ids"]
        yield SimpleNamespace(finished=True, outputs=outputs, prompt_token_ids=ids, num_cached_tokens=None)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def make_app(fake: FakeVllm) -> FastAPI:
    engine = LocalVLLMEngine(fake, name="fake", tensor_parallel_size=1, sleep_mode_enabled=False)
    app = FastAPI()
    state = routes.SkyliftState(
        engine=engine,
        model_name="m",
        model_path="m",
        max_model_len=MAX_MODEL_LEN,
        vocab_size=100,
        platform="cpu",
    )
    routes.install_routes(app, state)
    return app


def generate(client: TestClient, prompts: int, **sampling: Any) -> Any:
    body = {
        "prompt_token_ids": [[1, 2]] * prompts,
        "sampling_params": {"max_tokens": 1, "logprobs": False, **sampling},
    }
    return client.post("/skylift/generate", json=body)


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(make_app(FakeVllm()))


@pytest.mark.parametrize("seed", [SEED_MAX + 1, SEED_MIN - 1, 2**64, -(2**70)])
def test_seed_outside_int64_is_refused_before_the_engine(client: TestClient, seed: int) -> None:
    resp = generate(client, 1, seed=seed)
    assert resp.status_code == 422, resp.text  # vLLM's handler makes it a 400 in the server
    assert "seed" in resp.text


@pytest.mark.parametrize("seed", [SEED_MAX, SEED_MIN, 0])
def test_seed_inside_int64_is_served(client: TestClient, seed: int) -> None:
    resp = generate(client, 1, seed=seed)
    assert resp.status_code == 200, resp.text


def test_sequences_per_request_are_bounded_and_the_message_names_the_option(client: TestClient) -> None:
    n = 256
    prompts = MAX_SEQUENCES // n + 1
    resp = generate(client, prompts, n=n)
    assert resp.status_code == 400, resp.text
    message = resp.json()["detail"]
    assert f"{prompts * n} sequences" in message and "SKYLIFT_MAX_SEQUENCES" in message
    assert generate(client, MAX_SEQUENCES // n, n=n).status_code == 200


def test_tokens_per_request_are_bounded_and_the_message_names_the_option(client: TestClient) -> None:
    max_tokens = MAX_REQUEST_TOKENS // MAX_SEQUENCES + 1
    resp = generate(client, MAX_SEQUENCES // 16, n=16, max_tokens=max_tokens)
    assert resp.status_code == 400, resp.text
    assert "SKYLIFT_MAX_REQUEST_TOKENS" in resp.json()["detail"]


def test_typed_control_bodies_are_in_the_schema_with_their_bounds(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    seed = schema["components"]["schemas"]["SamplingParamsBody"]["properties"]["seed"]["anyOf"][0]
    assert seed["minimum"] <= SEED_MIN and seed["maximum"] >= SEED_MAX
    prompts = schema["components"]["schemas"]["GenerateBody"]["properties"]["prompt_token_ids"]
    assert prompts["maxItems"] >= 1 and prompts["items"]["maxItems"] >= 1
    for path in ("/skylift/pause", "/skylift/resume", "/sleep", "/wake_up", "/reset_prefix_cache"):
        assert "requestBody" in schema["paths"][path]["post"], path
    assert client.post("/skylift/pause", json={"mode": "forever"}).status_code == 422


class Disconnecting:
    """An ASGI request whose client leaves after `after_s`."""

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s

    async def receive(self) -> dict[str, Any]:
        await asyncio.sleep(self.after_s)
        return {"type": "http.disconnect"}


def test_a_client_that_leaves_aborts_its_generation() -> None:
    fake = FakeVllm(step_s=30.0)
    engine = LocalVLLMEngine(fake, name="fake", tensor_parallel_size=1, sleep_mode_enabled=False)
    from skylift.inference.types import SamplingParams

    async def run() -> None:
        work = engine.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=4, logprobs=False))
        started = time.monotonic()
        with pytest.raises(ClientDisconnected):
            await unless_disconnected(Disconnecting(0.2), work)
        assert time.monotonic() - started < 5.0

    asyncio.run(run())
    assert len(fake.started) == 2 and sorted(fake.aborted) == sorted(fake.started)


def test_a_client_that_stays_gets_the_answer() -> None:
    async def run() -> int:
        async def work() -> int:
            await asyncio.sleep(0.05)
            return 7

        return await unless_disconnected(Disconnecting(30.0), work())

    assert asyncio.run(run()) == 7


# ----------------------------------------------------------------------------- rendezvous


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture
def store() -> Any:
    """A real torch TCPStore (the trainer's rank 0 hosts one) on a free loopback port."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", 0, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)


def test_probe_of_a_live_store_returns_and_leaves_the_store_working(store: Any) -> None:
    started = time.monotonic()
    for _ in range(3):
        asyncio.run(probe_store("127.0.0.1", int(store.port), 5.0))
    assert time.monotonic() - started < 3.0
    store.set("after-probe", "ok")
    assert store.get("after-probe") == b"ok"


def test_probe_of_an_address_nobody_serves_fails_naming_it_after_the_timeout() -> None:
    port = closed_port()
    started = time.monotonic()
    with pytest.raises(EngineRequestError, match=f"127.0.0.1:{port}.*timeout_s=0.6"):
        asyncio.run(probe_store("127.0.0.1", port, 0.6))
    assert 0.4 <= time.monotonic() - started < 5.0


def test_probe_of_a_listener_that_is_no_store_fails_within_the_timeout() -> None:
    """torch's own store client would wait forever on such a peer (its ping has no timeout)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]
        started = time.monotonic()
        with pytest.raises(EngineRequestError, match=f"127.0.0.1:{port}.*timeout_s=0.8"):
            asyncio.run(probe_store("127.0.0.1", port, 0.8))
        assert time.monotonic() - started < 5.0


def test_probe_of_a_peer_that_answers_garbage_is_refused() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        port = listener.getsockname()[1]

        def answer() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=answer)
        thread.start()
        try:
            with pytest.raises(EngineRequestError, match=f"127.0.0.1:{port}.*no torch TCPStore"):
                asyncio.run(probe_store("127.0.0.1", port, 5.0))
        finally:
            thread.join()


def test_probe_waits_for_a_store_that_comes_late() -> None:
    from datetime import timedelta

    import torch.distributed as dist

    port = closed_port()
    stores: list[Any] = []

    def late() -> None:
        time.sleep(0.5)
        stores.append(
            dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False)
        )

    thread = threading.Thread(target=late)
    thread.start()
    try:
        asyncio.run(probe_store("127.0.0.1", port, 10.0))
    finally:
        thread.join()
    assert stores


def test_probe_of_a_name_that_does_not_resolve_fails_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(EngineRequestError, match="cannot resolve"):
        asyncio.run(probe_store("no-such-host.invalid", 5, 30.0))
    assert time.monotonic() - started < 20.0


class FakeWorkers:
    """The join RPC as `LocalVLLMEngine._rpc` makes it: records each call; fails with `error`."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error = error
        self.calls: list[tuple[str, tuple, float]] = []

    async def __call__(self, operation: str, method: str, args: tuple, timeout_s: float) -> list[Any]:
        self.calls.append((method, args, timeout_s))
        if self.error is not None:
            raise self.error
        return [None]


def spec_at(port: int, timeout_s: float = 2.0, world_size: int = 2) -> WeightUpdateGroupSpec:
    return WeightUpdateGroupSpec(
        master_address="127.0.0.1",
        master_port=port,
        rank_offset=1,
        world_size=world_size,
        timeout_s=timeout_s,
    )


def trainer_hosts(store: Any) -> None:
    """What the trainer's rank 0 does when it hosts the group: counts itself as on its way."""
    announce_ranks(store, WeightUpdateGroupSpec("", 0, 1, 2).group_name, 1)


def test_join_reaches_the_workers_only_after_a_store_answered(store: Any) -> None:
    trainer_hosts(store)
    workers = FakeWorkers()
    asyncio.run(join_weight_update_group(workers, spec_at(int(store.port)), "join"))
    [(method, args, timeout_s)] = workers.calls
    assert method == "join" and args[:2] == ("127.0.0.1", int(store.port))
    # the worker's own bounds (store, rendezvous, handshake) end before the RPC's
    assert timeout_s == join_rpc_timeout_s(2.0) > 3 * 2.0

    nobody = FakeWorkers()
    with pytest.raises(EngineRequestError):
        asyncio.run(join_weight_update_group(nobody, spec_at(closed_port(), 0.3), "join"))
    assert nobody.calls == []


def test_ranks_that_never_come_fail_before_the_engine_is_involved_and_the_loop_serves_meanwhile(
    store: Any,
) -> None:
    """The trainer hosts and this engine's 2 workers come, but a third rank (another engine) never
    does: a request error naming the address and the count, the workers never asked to join, the
    server's event loop free all along, and this engine's ranks taken back from the count."""
    trainer_hosts(store)
    workers = FakeWorkers()
    ticks: list[float] = []

    async def serve_while_joining() -> None:
        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.05)

        ticker = asyncio.create_task(tick())
        try:
            await join_weight_update_group(
                workers, spec_at(int(store.port), 1.0, world_size=4), "join", ranks=2
            )
        finally:
            ticker.cancel()

    started = time.monotonic()
    with pytest.raises(EngineRequestError, match=rf"127\.0\.0\.1:{store.port}: only 3 of its 4 ranks came"):
        asyncio.run(serve_while_joining())
    assert workers.calls == []
    assert len(ticks) >= 0.5 * (time.monotonic() - started) / 0.05  # the loop was never held
    assert announce_ranks(store, WeightUpdateGroupSpec("", 0, 1, 2).group_name, 0) == 1


def test_every_engine_joins_once_all_ranks_are_on_their_way(store: Any) -> None:
    """Two engines of one group, told at different times: neither joins before the other came."""
    trainer_hosts(store)
    first, second = FakeWorkers(), FakeWorkers()
    spec = spec_at(int(store.port), 5.0, world_size=3)

    async def both() -> None:
        early = asyncio.create_task(join_weight_update_group(first, spec, "join"))
        await asyncio.sleep(0.5)
        assert first.calls == []  # still waiting for the second engine
        await join_weight_update_group(second, spec, "join")
        await early

    asyncio.run(both())
    assert len(first.calls) == len(second.calls) == 1


def test_skyrls_trainer_announces_nothing_and_is_not_waited_for(store: Any) -> None:
    workers = FakeWorkers()
    spec = WeightUpdateGroupSpec("127.0.0.1", int(store.port), 1, 2, timeout_s=2.0, protocol="skyrl")
    asyncio.run(join_weight_update_group(workers, spec, "join"))
    assert len(workers.calls) == 1


def test_a_rendezvous_the_workers_could_not_complete_is_a_request_error_naming_the_address(
    store: Any,
) -> None:
    trainer_hosts(store)
    port = int(store.port)
    failed = EngineError(
        f"local-vllm: init_weight_update_communicator: could not join weight-sync group 'g' at "
        f"127.0.0.1:{port} as rank 1/2: wait timeout after 2000ms"
    )
    with pytest.raises(EngineRequestError, match=f"127.0.0.1:{port}.*wait timeout"):
        asyncio.run(join_weight_update_group(FakeWorkers(failed), spec_at(port), "join"))
    other = EngineError("local-vllm: init_weight_update_communicator: the worker ran out of memory")
    with pytest.raises(EngineError) as info:
        asyncio.run(join_weight_update_group(FakeWorkers(other), spec_at(port), "join"))
    assert not isinstance(info.value, EngineRequestError)
