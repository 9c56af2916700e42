"""`skylift serve` keeps serving every client while one client's request waits or fails.

On the keyed tiny-model server shared with the other reliability tests (`inference`):
- a weight-update init naming a rendezvous nobody serves waits off the engine: completions are
  answered during the wait, the init fails with a 400 naming the address, and the engine serves
  afterwards; the same for an address that accepts connections but is no store (torch's store
  client would wait there forever);
- a store that answers but whose other ranks never come: the workers' join ends with their own
  timeout (a 400 naming the address), before the RPC's, and the engine serves afterwards;
- `/skylift/generate` aborts its sequences when the client disconnects;
- seeds are bounded to int64 as in vLLM's API (outside: 400; at the bounds: served).
"""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from reliability_helpers import Api, error_message
from server_helpers import TINY_SERVED_NAME

pytestmark = pytest.mark.integration

#: How long one completion may take while another client's request waits.
COMPLETION_S = 20.0


def completion_ok(api: Api) -> float:
    """Seconds one 4-token completion took; fails unless it is a 200 with tokens."""
    started = time.monotonic()
    resp = httpx.post(
        api.url + "/v1/completions",
        json={"model": TINY_SERVED_NAME, "prompt": "hello", "max_tokens": 4},
        headers=api.headers,
        timeout=COMPLETION_S,
    )
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1
    return time.monotonic() - started


def init_in_background(api: Api, body: dict[str, Any]) -> tuple[threading.Thread, dict[str, Any]]:
    result: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        resp = httpx.post(
            api.url + "/init_weight_update_communicator", json=body, headers=api.headers, timeout=120
        )
        result.update(resp=resp, seconds=time.monotonic() - started)

    thread = threading.Thread(target=run)
    thread.start()
    return thread, result


def served_while(api: Api, thread: threading.Thread) -> list[float]:
    """Completion latencies while `thread` runs (at least three)."""
    latencies = []
    while thread.is_alive() or len(latencies) < 3:
        latencies.append(completion_ok(api))
        time.sleep(0.3)
    return latencies


def no_group(api: Api) -> None:
    info = api.request("GET", "/skylift/info")
    assert info.status_code == 200, info.text
    assert info.json()["has_weight_update_group"] is False, info.json()


@pytest.mark.timeout(300)
def test_init_with_a_rendezvous_nobody_serves_fails_with_a_400_and_completions_go_on(inference: Api) -> None:
    completion_ok(inference)
    body = {
        "master_address": "127.0.0.1",
        "master_port": 1,
        "rank_offset": 1,
        "world_size": 2,
        "timeout_s": 8,
    }
    thread, result = init_in_background(inference, body)
    time.sleep(0.5)
    during = served_while(inference, thread)
    thread.join()
    resp = result["resp"]
    assert resp.status_code == 400, resp.text
    assert re.search(r"127\.0\.0\.1:1\b.*timeout_s=8", error_message(resp)), error_message(resp)
    assert 7.0 <= result["seconds"] < 30.0, result["seconds"]
    assert len(during) >= 3 and max(during) < COMPLETION_S
    for _ in range(3):
        completion_ok(inference)
    no_group(inference)


@pytest.mark.timeout(300)
def test_init_at_a_listener_that_is_no_store_fails_and_completions_go_on(inference: Api) -> None:
    """Something accepts connections at the address but never answers as a store: the server's
    probe gives up after timeout_s, the engine is never asked and serves throughout."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        port = listener.getsockname()[1]
        body = {
            "master_address": "127.0.0.1",
            "master_port": port,
            "rank_offset": 1,
            "world_size": 2,
            "timeout_s": 4,
        }
        thread, result = init_in_background(inference, body)
        time.sleep(0.5)
        during = served_while(inference, thread)
        thread.join()
    resp = result["resp"]
    assert resp.status_code == 400, resp.text
    assert f"127.0.0.1:{port}" in error_message(resp), error_message(resp)
    assert len(during) >= 3 and max(during) < COMPLETION_S
    completion_ok(inference)
    no_group(inference)


@pytest.mark.timeout(300)
def test_init_whose_other_ranks_never_come_fails_with_a_400_and_the_engine_serves(inference: Api) -> None:
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 3, True, timeout=timedelta(seconds=30), wait_for_workers=False)
    body = {
        "master_address": "127.0.0.1",
        "master_port": int(store.port),
        "rank_offset": 1,
        "world_size": 3,  # ranks 0 and 2 never join
        "timeout_s": 3,
    }
    started = time.monotonic()
    resp = inference.request("POST", "/init_weight_update_communicator", body)
    seconds = time.monotonic() - started
    assert resp.status_code == 400, resp.text
    assert f"127.0.0.1:{store.port}" in error_message(resp), error_message(resp)
    assert 2.5 <= seconds < 30.0, seconds
    for _ in range(3):
        completion_ok(inference)
    no_group(inference)


def running_requests(api: Api) -> float:
    text = httpx.get(api.url + "/metrics", timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.mark.timeout(300)
def test_generate_is_aborted_when_the_client_disconnects(inference: Api) -> None:
    body = {
        "prompt_token_ids": [[5, 6, 7, i] for i in range(16)],
        "sampling_params": {"max_tokens": 400, "n": 16, "ignore_eos": True, "logprobs": False},
    }
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(inference.url + "/skylift/generate", json=body, headers=inference.headers, timeout=3.0)
    deadline = time.monotonic() + 15.0
    while running_requests(inference) > 0 and time.monotonic() < deadline:
        time.sleep(0.25)
    assert running_requests(inference) == 0, "the sequences of a client that left still run"
    completion_ok(inference)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [2**63, -(2**63) - 1, 10**30])
def test_seed_outside_int64_is_a_400_and_the_engine_lives(inference: Api, seed: int) -> None:
    body = {"prompt_token_ids": [[1, 2]], "sampling_params": {"max_tokens": 2, "seed": seed}}
    resp = inference.request("POST", "/skylift/generate", body)
    assert resp.status_code == 400, resp.text
    assert "seed" in error_message(resp)
    completion_ok(inference)


@pytest.mark.timeout(300)
def test_seeds_at_the_int64_bounds_are_served(inference: Api) -> None:
    for seed in (2**63 - 1, -(2**63)):
        body = {"prompt_token_ids": [[1, 2]], "sampling_params": {"max_tokens": 2, "seed": seed}}
        resp = inference.request("POST", "/skylift/generate", body)
        assert resp.status_code == 200, resp.text
    completion_ok(inference)
