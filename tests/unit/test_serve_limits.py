"""`skylift serve`'s request limits, disconnect aborts and off-loop rendezvous, without an engine.

The routes run in a FastAPI app over `LocalVLLMEngine` wrapping a fake vLLM engine (no vLLM
process); the rendezvous helpers meet real sockets on loopback and a fake worker pool driving
the real worker-side join (`join_worker.BackgroundJoinExtension`).
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

from skylift.inference import rendezvous, routes
from skylift.inference.disconnect import ClientDisconnected, unless_disconnected
from skylift.inference.join_worker import BackgroundJoinExtension
from skylift.inference.limits import MAX_REQUEST_TOKENS, MAX_SEQUENCES, SEED_MAX, SEED_MIN
from skylift.inference.local import LocalVLLMEngine
from skylift.inference.rendezvous import join_in_background, wait_for_listener
from skylift.inference.types import EngineRequestError, EngineStateError, WeightUpdateGroupSpec

MAX_MODEL_LEN = 1 << 20  # large, so that the request limits, not the context, bind


class FakeVllm:
    """What `LocalVLLMEngine.generate` uses of vLLM's AsyncLLM: a stream per request, abort."""

    def __init__(self, step_s: float = 0.0) -> None:
        self.step_s = step_s
        self.started: list[str] = []
        self.aborted: list[str] = []

    async def generate(self, prompt: Any, params: Any, request_id: str, **_: Any) -> AsyncIterator[Any]:
        self.started.append(request_id)
        await asyncio.sleep(self.step_s)
        outputs = [
            SimpleNamespace(
                index=i, token_ids=[1], logprobs=None, finish_reason="length", stop_reason=None, text=""
            )
            for i in range(params.n)
        ]
        yield SimpleNamespace(finished=True, outputs=outputs, prompt_token_ids=prompt["prompt_token_ids"])

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


def test_probe_of_an_address_nobody_serves_fails_naming_it_after_the_timeout() -> None:
    port = closed_port()
    started = time.monotonic()
    with pytest.raises(EngineRequestError, match=f"127.0.0.1:{port}.*timeout_s=0.6"):
        asyncio.run(wait_for_listener("127.0.0.1", port, 0.6))
    assert 0.4 <= time.monotonic() - started < 5.0


def test_probe_waits_for_a_store_that_comes_late() -> None:
    port = closed_port()
    listener = socket.socket()

    def late() -> None:
        time.sleep(0.5)
        listener.bind(("127.0.0.1", port))
        listener.listen()

    thread = threading.Thread(target=late)
    thread.start()
    try:
        asyncio.run(wait_for_listener("127.0.0.1", port, 10.0))
    finally:
        thread.join()
        listener.close()


def test_probe_of_a_name_that_does_not_resolve_fails_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(EngineRequestError, match="cannot resolve"):
        asyncio.run(wait_for_listener("no-such-host.invalid", 5, 30.0))
    assert time.monotonic() - started < 20.0


class FakeWorker(BackgroundJoinExtension):
    """A worker whose group join takes `join_s` and then succeeds, or fails with `error`."""

    def __init__(self, join_s: float, error: str | None = None) -> None:
        self.join_s, self.error = join_s, error
        self.group: str | None = None
        self.destroyed = 0

    def skylift_init_weight_update_group(self, *args: Any) -> None:
        time.sleep(self.join_s)
        if self.error:
            raise RuntimeError(self.error)
        self.group = args[4]

    def skylift_destroy_weight_update_group(self) -> None:
        self.group = None
        self.destroyed += 1


def pool(workers: list[FakeWorker]) -> Any:
    async def rpc(operation: str, method: str, args: tuple, timeout_s: float) -> list[Any]:
        return [getattr(w, method)(*args) for w in workers]

    return rpc


SPEC = WeightUpdateGroupSpec(
    master_address="127.0.0.1", master_port=5, rank_offset=1, world_size=3, timeout_s=1.0
)


def test_background_join_polls_until_every_worker_joined_while_the_loop_runs() -> None:
    workers = [FakeWorker(0.3), FakeWorker(0.5)]

    async def run() -> int:
        ticks = 0

        async def ticker() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.02)
                ticks += 1

        task = asyncio.create_task(ticker())
        await join_in_background(pool(workers), SPEC, 5.0)
        task.cancel()
        return ticks

    assert asyncio.run(run()) >= 10  # the event loop (generation) went on during the join
    assert [w.group for w in workers] == [SPEC.group_name] * 2


def test_background_join_failure_names_the_address_and_leaves_the_joined_workers() -> None:
    workers = [FakeWorker(0.05), FakeWorker(0.2, error="store timed out")]
    with pytest.raises(EngineRequestError, match="127.0.0.1:5: store timed out"):
        asyncio.run(join_in_background(pool(workers), SPEC, 5.0))
    assert workers[0].group is None and workers[0].destroyed == 1


def test_background_join_gives_up_after_its_bound_and_a_late_join_is_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(rendezvous, "JOIN_GRACE_S", 0.3)
    spec = WeightUpdateGroupSpec(
        master_address="127.0.0.1", master_port=5, rank_offset=1, world_size=2, timeout_s=0.01
    )
    worker = FakeWorker(1.5)
    rpc = pool([worker])

    async def run() -> None:
        with pytest.raises(EngineRequestError, match="not every rank arrived"):
            await join_in_background(rpc, spec, 5.0)
        with pytest.raises(EngineStateError, match="still waiting"):
            await join_in_background(rpc, spec, 5.0)

    asyncio.run(run())
    deadline = time.monotonic() + 15
    while worker.skylift_join_status()["state"] == "running" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert worker.group is None and worker.destroyed == 1
