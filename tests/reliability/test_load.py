"""Concurrent load: 200 completion requests at once against the shared inference server, 0 errors.

No wall-clock assertion (the machine is shared); benchmarks/load_completions.py measures latency
and throughput with 1,000 concurrent requests.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest
from reliability_helpers import Api
from server_helpers import TINY_SERVED_NAME

pytestmark = pytest.mark.integration

CONCURRENCY = 200
MAX_TOKENS = 8


async def _one(client: httpx.AsyncClient, inference: Api, i: int) -> str:
    """'ok', or what went wrong with request `i`."""
    body = {"model": TINY_SERVED_NAME, "prompt": f"request {i}:", "max_tokens": MAX_TOKENS, "seed": i}
    try:
        resp = await client.post(inference.url + "/v1/completions", json=body, headers=inference.headers)
    except httpx.HTTPError as exc:
        return f"{type(exc).__name__}: {exc}"
    if resp.status_code != 200:
        return f"HTTP {resp.status_code}: {resp.text[:200]}"
    usage = resp.json()["usage"]
    if not 1 <= usage["completion_tokens"] <= MAX_TOKENS:
        return f"bad usage {usage}"
    return "ok"


async def _burst(inference: Api) -> Counter[str]:
    limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0)) as client:
        outcomes = await asyncio.gather(*(_one(client, inference, i) for i in range(CONCURRENCY)))
    return Counter(outcomes)


@pytest.mark.timeout(600)
def test_200_concurrent_completions_without_errors(inference: Api) -> None:
    outcomes = asyncio.run(_burst(inference))
    assert outcomes == Counter({"ok": CONCURRENCY}), outcomes.most_common(5)
    assert inference.request("GET", "/health").status_code == 200
