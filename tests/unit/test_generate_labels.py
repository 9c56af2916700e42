"""skylift serve's /inference/v1/generate answers carry the ``token_id:N`` labels verifiers'
clients check (skylift.inference.generate_compat), in-process through Starlette's test client."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from skylift.inference.generate_compat import GenerateTokenLabels, label_tokens

ANSWER = {
    "request_id": "r",
    "choices": [
        {
            "index": 0,
            "token_ids": [5, 7],
            "logprobs": {
                "content": [
                    {"token_id": 5, "logprob": -0.5, "top_logprobs": [{"token_id": 5, "logprob": -0.5}]},
                    {"token_id": 7, "logprob": -1.5, "top_logprobs": []},
                ]
            },
        }
    ],
}


async def generate(request: Request) -> JSONResponse:
    return JSONResponse(ANSWER)


async def other(request: Request) -> JSONResponse:
    return JSONResponse(ANSWER)


async def streamed(request: Request) -> StreamingResponse:
    async def events():  # type: ignore[no-untyped-def]
        yield b'data: {"token_id": 5}\n\n'

    return StreamingResponse(events(), media_type="text/event-stream")


def client(route: str = "/inference/v1/generate", endpoint=generate) -> TestClient:  # type: ignore[no-untyped-def]
    app = Starlette(
        routes=[Route(route, endpoint, methods=["POST"]), Route("/other", other, methods=["POST"])]
    )
    app.add_middleware(GenerateTokenLabels)
    return TestClient(app)


def test_generate_answers_get_token_labels_and_keep_token_ids() -> None:
    response = client().post("/inference/v1/generate", json={})
    assert response.status_code == 200
    assert int(response.headers["content-length"]) == len(response.content)
    content = response.json()["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["token_id"], e["logprob"]) for e in content] == [
        ("token_id:5", 5, -0.5),
        ("token_id:7", 7, -1.5),
    ]
    assert content[0]["top_logprobs"] == [{"token_id": 5, "logprob": -0.5, "token": "token_id:5"}]


def test_other_routes_and_streamed_answers_pass_untouched() -> None:
    assert "token" not in client().post("/other", json={}).json()["choices"][0]["logprobs"]["content"][0]
    streamed_answer = client(endpoint=streamed).post("/inference/v1/generate", json={})
    assert streamed_answer.text == 'data: {"token_id": 5}\n\n'

    async def error(request: Request) -> PlainTextResponse:
        return PlainTextResponse("bad", status_code=400)

    refused = client(endpoint=error).post("/inference/v1/generate", json={})
    assert refused.status_code == 400 and refused.text == "bad"


def test_label_tokens_leaves_labelled_and_odd_entries_alone() -> None:
    payload = {
        "choices": [{"logprobs": {"content": [{"token": "x", "token_id": 1}, "odd", {"token_id": "2"}]}}]
    }
    assert label_tokens(payload) == {
        "choices": [{"logprobs": {"content": [{"token": "x", "token_id": 1}, "odd", {"token_id": "2"}]}}]
    }
    assert label_tokens([1]) == [1] and label_tokens({"choices": None}) == {"choices": None}
