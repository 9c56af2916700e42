"""vLLM's /inference/v1/generate behind skylift's guard (skylift.inference.vllm_patches.generate_guard).

Malformed bodies (the one schemathesis found answered with a 500 by vLLM, ids outside the
vocabulary, negative or beyond-int64 ids, max_tokens beyond the context, wrong types, non-finite
floats, oversized bodies) get a 4xx naming the field, in-process: the guard is installed by
`routes.install_routes` in front of vLLM's own route (its real router and request model), whose
handler is a fake that records what vLLM parsed. Well-formed bodies reach vLLM byte for byte.
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from skylift.inference import routes
from skylift.inference.limits import MAX_N, SEED_MAX
from skylift.inference.local import LocalVLLMEngine
from skylift.inference.vllm_patches.generate_body import GenerateLimits, check_generate_body
from skylift.inference.vllm_patches.generate_guard import GenerateGuard

VOCAB = 100
MAX_MODEL_LEN = 64
LIMITS = GenerateLimits(vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN)
PATH = "/inference/v1/generate"
GOOD: dict[str, Any] = {
    "model": "m",
    "token_ids": [1, 2, 3],
    "sampling_params": {"max_tokens": 8, "temperature": 0.7, "logprobs": 1, "stop_token_ids": [99]},
}
#: schemathesis' body that vLLM answered with a 500 (CI, session 12), with the prompt it cut off
FUZZED: dict[str, Any] = {
    "Ù/Í\x84": -60978034837507,
    "f=\x04â\x16\x8a\U000d5198Í": [-318, {"\x96¹\x99MÛ\x18þÄ": -1.5367370054843417e190, "": 289}, []],
    "token_ids": [3, 7],
    "sampling_params": {
        "\U000a7884UTi+\x89": {},
        "": [[]],
        "max_tokens": 11904,
        "output_kind": 2,
        "trace_decode_token_ids": [19522, 133, 1170, -35645400373, 1937, 75412730411],
    },
}


class FakeServingTokens:
    """vLLM's `ServingTokens` as its route calls it: records the parsed request, answers."""

    def __init__(self) -> None:
        self.requests: list[Any] = []

    async def serve_tokens(self, request: Any, raw_request: Any) -> Any:
        from vllm.entrypoints.scale_out.token_in_token_out.protocol import (
            GenerateTokensChoice,
            GenerateTokensResponse,
        )

        self.requests.append(request)
        return GenerateTokensResponse(
            request_id=request.request_id, choices=[GenerateTokensChoice(index=0, token_ids=[5])]
        )


@pytest.fixture(scope="module")
def served() -> tuple[TestClient, FakeServingTokens]:
    from vllm.entrypoints.scale_out.token_in_token_out import api_router

    app = FastAPI()
    app.state.args = SimpleNamespace(tokens_only=False)
    api_router.attach_router(app)  # vLLM's own route and request model
    fake = FakeServingTokens()
    app.state.serving_tokens = fake
    engine = LocalVLLMEngine(SimpleNamespace(), name="fake", tensor_parallel_size=1, sleep_mode_enabled=False)
    state = routes.SkyliftState(
        engine=engine,
        model_name="m",
        model_path="m",
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB,
        platform="cpu",
    )
    routes.install_routes(app, state)
    return TestClient(app), fake


def refused(client: TestClient, body: Any, status: int = 400) -> str:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = client.post(PATH, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert error["code"] == status
    return str(error["message"])


def with_sampling(**sampling: Any) -> dict[str, Any]:
    return {**GOOD, "sampling_params": {**GOOD["sampling_params"], **sampling}}


def test_a_well_formed_body_reaches_vllm_byte_for_byte(served: tuple[TestClient, FakeServingTokens]) -> None:
    client, fake = served
    # unknown keys (vLLM ignores them) and odd spacing stay as they were
    raw = json.dumps({**GOOD, "x-client-tag": [1, "a"]}, indent=3).encode()
    before = len(fake.requests)
    resp = client.post(PATH, content=raw, headers={"content-type": "application/json"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == [5]
    assert len(fake.requests) == before + 1
    parsed = fake.requests[-1]
    assert parsed.token_ids == GOOD["token_ids"]
    assert parsed.sampling_params.max_tokens == 8 and parsed.sampling_params.stop_token_ids == [99]


def test_the_fuzzed_body_that_got_a_500_is_a_400_naming_its_fields(
    served: tuple[TestClient, FakeServingTokens],
) -> None:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    GenerateRequest.model_validate(FUZZED)  # vLLM's own model lets it through
    client, fake = served
    before = len(fake.requests)
    message = refused(client, FUZZED)
    assert (
        "sampling_params.max_tokens: max_tokens=11904 leaves no room for a prompt: max_model_len is 64"
        in message
    )
    assert (
        "sampling_params.trace_decode_token_ids[0]: token id 19522 is outside the vocabulary [0, 100)"
        in message
    )
    assert len(fake.requests) == before  # vLLM never saw it


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({**GOOD, "token_ids": [1, VOCAB]}, "token_ids[1]: token id 100 is outside the vocabulary [0, 100)"),
        ({**GOOD, "token_ids": [-5, 1]}, "token_ids[0]: token id -5 is outside the vocabulary"),
        ({**GOOD, "token_ids": [1, 2**70]}, f"token_ids[1]: token id {2**70} is outside the vocabulary"),
        ({**GOOD, "token_ids": []}, "token_ids: List should have at least 1 item"),
        ({**GOOD, "token_ids": [1] * MAX_MODEL_LEN}, "token_ids: 64 prompt tokens leave no room"),
        ({**GOOD, "token_ids": "1 2 3"}, "token_ids: Input should be a valid list"),
        ({"token_ids": [1]}, "sampling_params: Field required"),
        (with_sampling(max_tokens=10**9), "sampling_params.max_tokens: max_tokens=1000000000 leaves no room"),
        (
            with_sampling(max_tokens=2**64),
            "sampling_params.max_tokens: Input should be less than or equal to",
        ),
        (
            with_sampling(max_tokens=0),
            "sampling_params.max_tokens: Input should be greater than or equal to 1",
        ),
        (
            with_sampling(min_tokens=9),
            "sampling_params.min_tokens: min_tokens=9 must be at most max_tokens=8",
        ),
        (with_sampling(n=MAX_N + 1), f"sampling_params.n: n={MAX_N + 1} is too large"),
        (with_sampling(n="many"), "sampling_params.n: Input should be a valid integer"),
        (with_sampling(temperature=[1]), "sampling_params.temperature: Input should be a valid number"),
        (
            with_sampling(temperature=3.0),
            "sampling_params.temperature: Input should be less than or equal to 2",
        ),
        (with_sampling(seed=SEED_MAX + 1), "sampling_params.seed: Input should be less than or equal to"),
        (with_sampling(stop_token_ids=[7, -1]), "sampling_params.stop_token_ids[1]: token id -1 is outside"),
        (with_sampling(logit_bias={"5000": 1.0}), "sampling_params.logit_bias[0]: token id 5000 is outside"),
        (with_sampling(allowed_token_ids=[VOCAB + 1]), "sampling_params.allowed_token_ids[0]: token id 101"),
        (with_sampling(logprobs=VOCAB + 1), "sampling_params.logprobs: 101 is more than the vocabulary's"),
        (
            with_sampling(trace_decode_token_ids=[]),
            "sampling_params.trace_decode_token_ids: List should have",
        ),
        (with_sampling(prompt_logprob_token_ids=[[1, -2]]), "prompt_logprob_token_ids[0][1]: token id -2"),
        (
            with_sampling(output_kind=7),
            "sampling_params.output_kind: Input should be less than or equal to 2",
        ),
        (with_sampling(skip_clone=True), "sampling_params.skip_clone: Input should be False"),
        (with_sampling(stop=["x"] * 65), "sampling_params.stop"),
        ({**GOOD, "priority": -(2**64)}, "priority: Input should be greater than or equal to"),
        ({**GOOD, "output_mode": "logits"}, "output_mode: Input should be 'tokens' or 'text'"),
        ({**GOOD, "features": {"mm_hashes": {}}}, "features: this server's model takes no multimodal input"),
        ([1, 2], "body: must be a JSON object, got list"),
    ],
)
def test_a_malformed_body_is_a_400_naming_the_field(
    served: tuple[TestClient, FakeServingTokens], body: Any, expected: str
) -> None:
    client, fake = served
    before = len(fake.requests)
    message = refused(client, body)
    assert message.startswith("invalid /inference/v1/generate request: ")
    assert expected in message, message
    assert len(fake.requests) == before


def test_non_finite_floats_and_broken_json_are_400s(served: tuple[TestClient, FakeServingTokens]) -> None:
    client, _ = served
    nan = b'{"token_ids": [1], "sampling_params": {"temperature": NaN}}'
    assert "sampling_params.temperature: Input should be a finite number" in refused(client, nan)
    inf = b'{"token_ids": [1], "sampling_params": {"repetition_penalty": Infinity}}'
    assert "sampling_params.repetition_penalty: Input should be a finite number" in refused(client, inf)
    assert "body: not valid JSON" in refused(client, b'{"token_ids": [1')


def test_an_oversized_body_is_a_413_before_it_is_read() -> None:
    seen: list[bytes] = []

    async def endpoint(scope: Any, receive: Any, send: Any) -> None:  # pragma: no cover - never reached
        seen.append(b"reached")

    guard = GenerateGuard(endpoint, limits=LIMITS, max_body_bytes=1024)
    client = TestClient(guard)
    resp = client.post(
        PATH, content=b"[" + b"1," * 2000 + b"1]", headers={"content-type": "application/json"}
    )
    assert resp.status_code == 413
    assert "exceeds 1024 bytes" in resp.json()["error"]["message"]
    assert "SKYLIFT_MAX_GENERATE_BODY_MB" in resp.json()["error"]["message"]

    def chunks() -> Any:  # no Content-Length: counted as it arrives
        for _ in range(100):
            yield b" " * 100

    resp = client.post(PATH, content=chunks(), headers={"content-type": "application/json"})
    assert resp.status_code == 413
    assert not seen


def test_other_routes_and_methods_pass_untouched() -> None:
    calls: list[str] = []

    async def endpoint(scope: Any, receive: Any, send: Any) -> None:
        calls.append(f"{scope['method']} {scope['path']}")
        await send({"type": "http.response.start", "status": 204, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    client = TestClient(GenerateGuard(endpoint, limits=LIMITS, max_body_bytes=16))
    assert client.post("/v1/completions", content=b"x" * 100).status_code == 204
    assert client.get(PATH).status_code == 204
    assert calls == ["POST /v1/completions", f"GET {PATH}"]


def test_what_the_guard_passes_vllm_parses_and_what_it_refuses_is_named() -> None:
    from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest

    good = [
        GOOD,
        with_sampling(stop="###", seed=-1, top_k=-1, n=2, logit_bias={"3": -100.0}),
        {**GOOD, "stream": True},
    ]
    for body in good:
        assert check_generate_body(body, LIMITS) == [], body
        GenerateRequest.model_validate(body)
    multimodal = GenerateLimits(vocab_size=VOCAB, max_model_len=MAX_MODEL_LEN, multimodal=True)
    assert check_generate_body({**GOOD, "content_parts": [{"type": "image_url"}]}, multimodal) == []
    problems = check_generate_body(with_sampling(max_tokens=100, temperature=-1), LIMITS)
    assert {p.field for p in problems} == {"sampling_params.temperature"}  # types first, then limits
