"""LoadRouter (sticky sessions, least-loaded), URL normalisation and the pooled HTTP session."""

from __future__ import annotations

import asyncio

import pytest

from skylift.inference.http_session import SessionPool, connection_limit, keepalive_s
from skylift.inference.pool import EnginePool
from skylift.inference.remote import RemoteEngineError, RemoteInferenceEngine, normalize_url
from skylift.inference.routing import LoadRouter, NoServerLeftError
from skylift.inference.types import EngineRequestError


def test_pick_prefers_least_loaded_server():
    router = LoadRouter(3)
    router.acquire(0, 5)
    router.acquire(1, 2)
    assert router.pick() == 2
    router.acquire(2, 7)
    assert router.pick() == 1


def test_idle_pool_spreads_single_requests():
    router = LoadRouter(3)
    picks = {router.pick() for _ in range(3)}
    assert picks == {0, 1, 2}


def test_session_is_sticky_even_when_its_server_is_busy():
    router = LoadRouter(2)
    first = router.pick("conversation-1")
    router.acquire(first, 100)
    assert router.pick("conversation-1") == first
    assert router.pick("conversation-2") == 1 - first
    router.forget("conversation-1")
    assert router.pick("conversation-1") == 1 - first


def test_disabled_servers_get_no_work_and_their_sessions_move():
    router = LoadRouter(3)
    pinned = router.pick("conversation")
    router.disable(pinned)
    assert pinned not in router.enabled and len(router.enabled) == 2
    moved = router.pick("conversation")
    assert moved != pinned and router.pick("conversation") == moved  # sticky on its new server
    assert pinned not in {router.pick() for _ in range(6)}
    assert pinned not in router.assign([1] * 6)
    for index in router.enabled:
        router.disable(index)
    with pytest.raises(NoServerLeftError):
        router.pick()
    with pytest.raises(NoServerLeftError):
        router.assign([1])


def test_session_memory_is_bounded_lru():
    router = LoadRouter(2, max_sessions=2)
    router.pick("a")
    router.pick("b")
    router.pick("a")  # refreshes a
    router.pick("c")  # evicts b, the least recently used
    assert router.session_server("a") is not None
    assert router.session_server("b") is None
    assert router.session_server("c") is not None


def test_assign_balances_weighted_batch_against_current_load():
    router = LoadRouter(2)
    router.acquire(0, 4)
    assignment = router.assign([2, 2, 2, 2])
    loads = [4, 0]
    for index, weight in zip(assignment, [2, 2, 2, 2], strict=True):
        loads[index] += weight
    assert loads == [6, 6]
    assert router.in_flight == [4, 0]  # assign does not acquire


def test_release_never_goes_negative_and_checks_index():
    router = LoadRouter(2)
    router.acquire(1, 1)
    router.release(1, 5)
    assert router.in_flight == [0, 0]
    with pytest.raises(IndexError, match="out of range"):
        router.acquire(2)
    with pytest.raises(ValueError, match="at least one server"):
        LoadRouter(0)
    with pytest.raises(ValueError, match=">= 0"):
        router.assign([1, -1])


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("127.0.0.1:8001", "http://127.0.0.1:8001"),
        ("http://host:80/", "http://host:80"),
        ("https://example.org/api/", "https://example.org/api"),
        (" localhost:9 ", "http://localhost:9"),
    ],
)
def test_normalize_url(raw, expected):
    assert normalize_url(raw) == expected


def test_normalize_url_rejects_empty():
    with pytest.raises(ValueError, match="empty"):
        normalize_url("  ")


def test_client_rejects_duplicate_and_empty_urls():
    with pytest.raises(ValueError, match="duplicate"):
        EnginePool.from_urls(["127.0.0.1:1", "http://127.0.0.1:1/"])
    with pytest.raises(ValueError, match="at least one"):
        EnginePool.from_urls([])


def test_env_settings(monkeypatch):
    monkeypatch.setenv("SKYLIFT_HTTP_CONNECTION_LIMIT", "17")
    monkeypatch.setenv("SKYLIFT_HTTP_KEEPALIVE_S", "2.5")
    assert connection_limit() == 17
    assert keepalive_s() == 2.5
    pool = SessionPool()
    assert (pool.limit, pool.keepalive) == (17, 2.5)
    monkeypatch.setenv("SKYLIFT_HTTP_CONNECTION_LIMIT", "lots")
    with pytest.raises(ValueError, match="SKYLIFT_HTTP_CONNECTION_LIMIT"):
        connection_limit()
    monkeypatch.delenv("SKYLIFT_HTTP_CONNECTION_LIMIT")
    monkeypatch.delenv("SKYLIFT_HTTP_KEEPALIVE_S")
    assert connection_limit() == 256
    assert keepalive_s() < 5.0  # below uvicorn's keep-alive


def test_session_pool_one_session_per_loop():
    pool = SessionPool(limit=8, keepalive=1.0)

    async def get_twice():
        a = pool.get()
        b = pool.get()
        assert a is b
        assert a.connector.limit == 8
        return a

    first = asyncio.run(get_twice())
    second = asyncio.run(get_twice())  # a new loop gets a new session
    assert first is not second
    assert first.closed  # the old loop's session was detached
    asyncio.run(pool.close())


def test_connection_errors_name_server_and_operation():
    async def run():
        # Port 9 on loopback: nothing listens, the connection is refused at once.
        client = RemoteInferenceEngine("127.0.0.1:9", max_retries=1, backoff_s=0.01, timeout_s=5)
        with pytest.raises(RemoteEngineError) as info:
            await client.reset_prefix_cache()
        assert await client.health() is False
        await client.close()
        return info.value

    err = asyncio.run(run())
    assert err.url == "http://127.0.0.1:9"
    assert err.operation == "reset_prefix_cache"
    assert "reset_prefix_cache on http://127.0.0.1:9" in str(err)


def test_refused_connections_mark_the_engine_unavailable():
    from skylift.inference.pool import EnginePool, NoHealthyEngineError
    from skylift.inference.remote import RemoteInferenceEngine
    from skylift.inference.types import EngineUnavailableError, SamplingParams

    async def run():
        engine = RemoteInferenceEngine("127.0.0.1:9", max_retries=0, timeout_s=5)
        with pytest.raises(EngineUnavailableError):
            await engine.generate([[1, 2]], SamplingParams(max_tokens=2))
        pool = EnginePool([engine, RemoteInferenceEngine("127.0.0.1:7", max_retries=0, timeout_s=5)])
        with pytest.raises(NoHealthyEngineError) as info:
            await pool.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=2))
        assert sorted(pool.failures) == [0, 1] and pool.live_indices == []
        with pytest.raises(NoHealthyEngineError):
            await pool.reset_prefix_cache()
        await pool.close()  # closing failed engines is not an error
        return str(info.value)

    message = asyncio.run(run())
    assert "http://127.0.0.1:9" in message and "http://127.0.0.1:7" in message


def test_generation_retries_5xx_but_not_4xx():
    """A throwaway aiohttp server on loopback answers 503 twice, then 200; 400 is final."""
    from aiohttp import web

    from skylift.inference.remote import RemoteInferenceEngine
    from skylift.inference.types import SamplingParams

    calls = {"generate": 0, "bad": 0}

    async def generate(request: web.Request) -> web.Response:
        calls["generate"] += 1
        body = await request.json()
        if body["sampling_params"]["max_tokens"] == 999:
            calls["bad"] += 1
            return web.json_response({"error": {"message": "max_tokens too large"}}, status=400)
        if calls["generate"] <= 2:
            return web.json_response({"error": {"message": "busy"}}, status=503)
        prompt = body["prompt_token_ids"][0]
        comp = {"token_ids": [7, 8], "logprobs": [-0.5, -0.25], "stop_reason": "length", "text": None}
        return web.json_response({"outputs": [{"prompt_token_ids": prompt, "completions": [comp]}]})

    async def run():
        app = web.Application()
        app.router.add_post("/skylift/generate", generate)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        pool = SessionPool(limit=4, keepalive=1.0)
        engine = RemoteInferenceEngine(f"127.0.0.1:{port}", max_retries=3, backoff_s=0.01, session_pool=pool)
        try:
            out = await engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
            assert calls["generate"] == 3
            assert out[0].prompt_token_ids == [1, 2, 3]
            assert out[0].completions[0].token_ids == [7, 8]
            assert out[0].completions[0].logprobs == [-0.5, -0.25]
            with pytest.raises(RemoteEngineError, match="HTTP 400.*max_tokens too large") as info:
                await engine.generate([[1]], SamplingParams(max_tokens=999))
            assert info.value.status == 400
            assert isinstance(info.value, EngineRequestError)  # the request's fault: a rollout names it
            assert calls["bad"] == 1  # not retried
        finally:
            await pool.close()
            await runner.cleanup()

    asyncio.run(run())


# --------------------------------------------------------------- server-side input checks


@pytest.mark.parametrize(
    ("host", "loopback"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", True),
        ("::1", True),
        ("localhost", True),
        ("0.0.0.0", False),
        ("", False),
        (None, False),
        ("10.1.2.3", False),
        ("example.org", False),
    ],
)
def test_is_loopback_host(host, loopback):
    from skylift.inference.server import is_loopback_host

    assert is_loopback_host(host) is loopback


def test_validate_bucket_names_the_fault():
    """The server's 400s come from the weight-sync protocol's one check of a bucket."""
    from skylift.weight_sync.buckets import validate_bucket
    from skylift.weight_sync.protocol import WeightBucket

    def check(names, dtypes, shapes):
        return validate_bucket(WeightBucket(names=names, dtypes=dtypes, shapes=shapes)).dtypes

    assert check(["a", "b"], ["torch.float32", "bfloat16"], [[2], [3, 4]]) == [
        "float32",
        "bfloat16",
    ]
    with pytest.raises(ValueError, match="same length"):
        check(["a"], ["float32", "float32"], [[1]])
    with pytest.raises(ValueError, match="tensor 'a'.*unknown dtype 'float31'"):
        check(["a"], ["float31"], [[1]])
    with pytest.raises(ValueError, match="negative dimension"):
        check(["a"], ["float32"], [[-1]])
    with pytest.raises(ValueError, match="duplicate"):
        check(["a", "a"], ["float32", "float32"], [[1], [1]])
    with pytest.raises(ValueError, match="empty bucket"):
        check([], [], [])


def test_wire_sampling_params_match_the_interface():
    """The server's request model and `SamplingParams` must not drift apart (extra fields are 400s)."""
    from dataclasses import fields

    from skylift.inference.routes import SamplingParamsBody
    from skylift.inference.types import SamplingParams

    ours = {f.name: f.default for f in fields(SamplingParams)}
    wire = {name: info.default for name, info in SamplingParamsBody.model_fields.items()}
    assert ours == wire
    assert SamplingParamsBody(**SamplingParams(n=3, max_tokens=7).to_dict()).n == 3
