"""Hostile input: a table of malformed requests to both servers, each refused with a clear 4xx.

Every row is one request to the inference server (`skylift serve`) or the Tinker server (`skylift
tinker serve`). It must be answered in time (no hang), with its 4xx status (never a 500) and an error
message that says what was wrong (`message`, a case-insensitive regular expression). Tinker
operations report a bad request the protocol's way: the POST is accepted and the future fails with
`{"error", "category": "user"}`; those rows (`future=True`) check the future instead.

After the whole table both servers still serve a normal request, no Tinker sample request started an
inference engine, and no checkpoint name or path wrote anything outside the Tinker data directory.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from reliability_helpers import Api, TinkerModel, error_message, tinker_result
from server_helpers import TINY_SERVED_NAME, TinkerServer
from tinker.proto import tinker_public_pb2 as pb

pytestmark = pytest.mark.integration

TOKENS = [5, 6, 7, 8, 9, 10]


def _png(width: int = 8, height: int = 8) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (width, height), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


#: A valid PNG: the server must refuse it for what the model is, not for what the bytes are.
TINY_PNG = _png()
PROTOBUF = "application/x-protobuf"


@dataclass(frozen=True)
class Ctx:
    """What rows may refer to: the Tinker session and model, and a path outside its data dir."""

    session_id: str = ""
    model_id: str = ""
    outside: str = ""


Value = Any  # JSON-able, bytes, or Callable[[Ctx], JSON-able | bytes]


@dataclass(frozen=True)
class Row:
    id: str
    server: str  # "inference" | "tinker"
    method: str
    path: str | Callable[[Ctx], str]
    body: Value = None
    status: int = 400
    message: str = ""
    content_type: str | None = None
    headers: dict[str, str] = field(default_factory=dict)
    future: bool = False  # Tinker: accepted (200), then the future fails with category "user"


def fb(
    model_id: str,
    loss: str = "cross_entropy",
    tokens: list[int] = TOKENS,
    targets: list[int] | None = None,
    target_bytes: bytes | None = None,
    image: bytes | None = None,
) -> bytes:
    """A `ForwardBackwardRequest` with one datum (input `tokens`, `target_tokens` = next tokens)."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=0, loss_fn=loss)
    datum = msg.data.add()
    chunk = datum.model_input.add()
    if image is not None:
        chunk.image.data = image
        chunk.image.format = "png"
    else:
        chunk.encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
    target = np.asarray(targets if targets is not None else [t + 1 for t in tokens], dtype=np.int64)
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(
            dense=target.tobytes() if target_bytes is None else target_bytes,
            dtype=pb.DTYPE_INT64,
            shape=[len(target)],
        )
    )
    return msg.SerializeToString()


def text_prompt(tokens: list[Any]) -> dict[str, Any]:
    return {"chunks": [{"type": "encoded_text", "tokens": tokens}]}


def asample(**overrides: Any) -> dict[str, Any]:
    body = {
        "base_model": TINY_SERVED_NAME,
        "num_samples": 1,
        "prompt": text_prompt([1, 2, 3]),
        "sampling_params": {"max_tokens": 2},
    }
    return {**body, **overrides}


def completion(**overrides: Any) -> dict[str, Any]:
    return {"model": TINY_SERVED_NAME, "prompt": "hi", "max_tokens": 2, **overrides}


def chat(**overrides: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "hi"}]
    return {"model": TINY_SERVED_NAME, "messages": messages, "max_tokens": 2, **overrides}


def generate(**sampling: Any) -> dict[str, Any]:
    return {"prompt_token_ids": [[1, 2]], "sampling_params": {"max_tokens": 2, **sampling}}


INIT_GROUP = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
BAD_IMAGE = "data:image/png;base64,!!!this is not base64!!!"


def inf(
    id: str, method: str, path: str, body: Value = None, status: int = 400, message: str = "", **kw: Any
) -> Row:
    return Row(f"inference-{id}", "inference", method, path, body, status, message, **kw)


def tnk(
    id: str,
    method: str,
    route: str | Callable[[Ctx], str],
    body: Value = None,
    status: int = 400,
    message: str = "",
    **kw: Any,
) -> Row:
    path = (lambda c: "/api/v1/" + route(c)) if callable(route) else "/api/v1/" + route
    return Row(f"tinker-{id}", "tinker", method, path, body, status, message, **kw)


def tnk_future(id: str, route: str, body: Value, message: str, **kw: Any) -> Row:
    return tnk(id, "POST", route, body, 200, message, future=True, **kw)


ROWS: list[Row] = [
    # ---------------------------------------------------------------- inference: OpenAI routes (vLLM)
    inf("completions-bad-json", "POST", "/v1/completions", b"{not json", message="JSON decode error",
        content_type="application/json"),
    inf("completions-wrong-content-type", "POST", "/v1/completions",
        b'{"model": "tiny-qwen2", "prompt": "hi"}', message="only 'application/json'", content_type="text/plain"),
    inf("completions-max-tokens-not-a-number", "POST", "/v1/completions", completion(max_tokens="eight"),
        message="max_tokens"),
    inf("completions-negative-max-tokens", "POST", "/v1/completions", completion(max_tokens=-1),
        message="max_tokens"),
    inf("completions-huge-max-tokens", "POST", "/v1/completions", completion(max_tokens=10**9),
        message="max_tokens=1000000000 cannot be greater than max_model_len"),
    inf("completions-prompt-longer-than-context", "POST", "/v1/completions",
        completion(prompt=[7] * 600, max_tokens=4), message="maximum context length"),
    inf("completions-unknown-model", "POST", "/v1/completions", completion(model="no-such-model"), 404,
        "model `no-such-model` does not exist"),
    inf("completions-n-too-large", "POST", "/v1/completions", completion(n=1000), message="n must be at most 256"),
    inf("completions-too-many-logprobs", "POST", "/v1/completions", completion(logprobs=1000),
        message="logprobs of 1000"),
    inf("completions-token-outside-vocab", "POST", "/v1/completions", completion(prompt=[99999999]),
        message="out of vocabulary"),
    inf("completions-missing-prompt", "POST", "/v1/completions", {"model": TINY_SERVED_NAME, "max_tokens": 2},
        message="prompt"),
    inf("completions-wrong-method", "GET", "/v1/completions", status=405, message="method not allowed"),
    inf("chat-invalid-base64-image", "POST", "/v1/chat/completions",
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": BAD_IMAGE}}]}]),
        message="not a multimodal model"),
    inf("chat-messages-not-a-list", "POST", "/v1/chat/completions", chat(messages="hello"), message="messages"),
    inf("chat-unknown-model", "POST", "/v1/chat/completions", chat(model="no-such-model"), 404, "does not exist"),
    inf("chat-n-too-large", "POST", "/v1/chat/completions", chat(n=1000), message="n must be at most 256"),
    # Responses inputs vLLM 0.32's parser crashed on (500s found by test_fuzz_server.py)
    *[
        inf(f"responses-{what}-{route}", "POST", path,
            {"model": TINY_SERVED_NAME, "max_output_tokens": 2,
             "input": [{"type": "message", "role": "assistant", "content": content}]},
            message="input item of type 'message' cannot be read")
        for what, content in (("refusal-first", [{"type": "refusal", "refusal": "no"}]), ("empty-content", []))
        for route, path in (("render", "/v1/responses/render"), ("create", "/v1/responses"))
    ],
    # ---------------------------------------------------------------- inference: skylift routes
    inf("generate-truncated-json", "POST", "/skylift/generate", b'{"prompt_token_ids": [[1, 2]', message="JSON",
        content_type="application/json"),
    inf("generate-prompt-ids-not-a-list", "POST", "/skylift/generate", {"prompt_token_ids": "hello"},
        message="prompt_token_ids"),
    inf("generate-max-tokens-not-a-number", "POST", "/skylift/generate", generate(max_tokens="many"),
        message="max_tokens"),
    inf("generate-negative-max-tokens", "POST", "/skylift/generate", generate(max_tokens=-3), message="max_tokens"),
    inf("generate-huge-max-tokens", "POST", "/skylift/generate", generate(max_tokens=10**7), message="max_model_len"),
    inf("generate-prompt-longer-than-context", "POST", "/skylift/generate", {"prompt_token_ids": [[7] * 600]},
        message="exceeds max_model_len"),
    inf("generate-n-too-large", "POST", "/skylift/generate", generate(n=100000), message="n=100000 is too large"),
    inf("generate-seed-above-int64", "POST", "/skylift/generate", generate(seed=2**63),
        message="seed.*less than or equal to 9223372036854775807"),
    inf("generate-seed-below-int64", "POST", "/skylift/generate", generate(seed=-(2**63) - 1), message="seed"),
    inf("generate-a-million-sequences", "POST", "/skylift/generate",
        {"prompt_token_ids": [[1, 2]] * 4096, "sampling_params": {"max_tokens": 2, "n": 256}},
        message="1048576 sequences.*SKYLIFT_MAX_SEQUENCES"),
    inf("generate-too-many-stop-strings", "POST", "/skylift/generate", generate(stop=["x"] * 1000), message="stop"),
    inf("pause-unknown-mode", "POST", "/skylift/pause", {"mode": "forever"}, message="mode"),
    inf("resume-negative-version", "POST", "/skylift/resume", {"policy_version": -1}, message="policy_version"),
    inf("generate-temperature-out-of-range", "POST", "/skylift/generate", generate(temperature=9.0),
        message="temperature"),
    inf("generate-token-outside-vocab", "POST", "/skylift/generate", {"prompt_token_ids": [[1, 99999]]},
        message="outside the vocabulary"),
    inf("generate-empty-prompt", "POST", "/skylift/generate", {"prompt_token_ids": [[]]}, message="prompt 0 is empty"),
    inf("generate-no-prompts", "POST", "/skylift/generate", {"prompt_token_ids": []}, message="at least one"),
    inf("generate-unknown-field", "POST", "/skylift/generate", generate(max_token=5), message="max_token"),
    inf("generate-protobuf-body", "POST", "/skylift/generate", b"\x0a\x02\x08\x01", message="valid dictionary",
        content_type=PROTOBUF),
    inf("update-weights-unknown-dtype", "POST", "/update_weights",
        {"names": ["w"], "dtypes": ["float33"], "shapes": [[2]]}, message="float33"),
    inf("update-weights-length-mismatch", "POST", "/update_weights",
        {"names": ["w", "v"], "dtypes": ["float32"], "shapes": [[2], [3]]}, message="same length"),
    inf("update-weights-negative-dimension", "POST", "/update_weights",
        {"names": ["w"], "dtypes": ["float32"], "shapes": [[-2]]}, message="negative dimension"),
    inf("update-weights-missing-shapes", "POST", "/update_weights", {"names": ["w"], "dtypes": ["float32"]},
        message="shapes"),
    inf("update-weights-without-group", "POST", "/update_weights",
        {"names": ["w"], "dtypes": ["float32"], "shapes": [[2]]}, 409, "init_weight_update_communicator first"),
    inf("update-weight-without-group", "POST", "/update_weight", {"name": "w", "dtype": "float32", "shape": [2]},
        409, "init_weight_update_communicator first"),
    inf("update-weight-shape-not-a-list", "POST", "/update_weight", {"name": "w", "dtype": "float32", "shape": "big"},
        message="shape"),
    inf("init-group-world-size-too-small", "POST", "/init_weight_update_communicator",
        {**INIT_GROUP, "world_size": 1}, message="world_size"),
    inf("init-group-unknown-backend", "POST", "/init_weight_update_communicator", {**INIT_GROUP, "backend": "mpi"},
        message="backend"),
    inf("init-group-port-out-of-range", "POST", "/init_weight_update_communicator",
        {**INIT_GROUP, "master_port": 70000}, message="master_port"),
    inf("init-group-not-json", "POST", "/init_weight_update_communicator", b"not json", message="JSON",
        content_type="application/json"),
    inf("sleep-level-out-of-range", "POST", "/sleep", {"level": 5}, message="level"),
    # ---------------------------------------------------------------- tinker: sessions and models
    tnk("create-session-bad-json", "POST", "create_session", b"{nope", message="the body is not JSON",
        content_type="application/json"),
    tnk("create-session-not-an-object", "POST", "create_session", [1, 2], message="expected a JSON object"),
    tnk("create-session-metadata-not-an-object", "POST", "create_session", {"user_metadata": "x"},
        message=r"user_metadata: Input should be a valid dictionary"),
    tnk("heartbeat-unknown-session", "POST", "session_heartbeat", {"session_id": "s-nope"}, 404, "unknown session"),
    tnk("finish-session-reason-not-an-object", "POST", "sessions/s-nope/finish", {"reason": "done"},
        message=r"reason: Input should be a valid dictionary"),
    tnk_future("create-model-unknown-base-model", "create_model",
               lambda c: {"session_id": c.session_id, "model_seq_id": 11, "base_model": "gpt-17"}, "not served here"),
    tnk_future("create-model-unknown-session", "create_model",
               {"session_id": "s-nope", "model_seq_id": 0, "base_model": TINY_SERVED_NAME}, "unknown session"),
    tnk("create-model-seq-id-not-an-integer", "POST", "create_model",
        lambda c: {"session_id": c.session_id, "model_seq_id": "first", "base_model": TINY_SERVED_NAME},
        message=r"create_model: malformed request \(model_seq_id: Input should be a valid integer"),
    tnk("create-model-lora-config-not-an-object", "POST", "create_model",
        lambda c: {"session_id": c.session_id, "model_seq_id": 12, "base_model": TINY_SERVED_NAME,
                   "lora_config": [4]}, message=r"lora_config: Input should be a valid dictionary"),
    tnk_future("create-model-negative-rank", "create_model",
               lambda c: {"session_id": c.session_id, "model_seq_id": 13, "base_model": TINY_SERVED_NAME,
                          "lora_config": {"rank": -4}}, "rank must be >= 0"),
    tnk("get-info-unknown-model", "POST", "get_info", {"model_id": "s-nope:train:0"}, 404, "unknown model id"),
    # ---------------------------------------------------------------- tinker: forward_backward (protobuf)
    tnk("forward-backward-garbage-protobuf", "POST", "forward_backward", b"\xff\xff\xff\xff\xff",
        message="not a ForwardBackwardRequest protobuf", content_type=PROTOBUF),
    tnk("forward-backward-json-instead-of-protobuf", "POST", "forward_backward",
        b'{"model_id": "x", "loss_fn": "cross_entropy"}', message="not a ForwardBackwardRequest protobuf",
        content_type="application/json"),
    tnk("forward-backward-bad-zstd", "POST", "forward_backward", b"\x00\x01\x02", message="not valid zstd",
        content_type=PROTOBUF, headers={"Content-Encoding": "zstd"}),
    tnk("forward-backward-truncated-tensor", "POST", "forward_backward",
        lambda c: fb(c.model_id, target_bytes=b"\x01\x02\x03"), message="not a whole number of int64",
        content_type=PROTOBUF),
    tnk_future("forward-backward-unknown-loss", "forward_backward", lambda c: fb(c.model_id, loss="no_such_loss"),
               "unknown loss_fn 'no_such_loss'", content_type=PROTOBUF),
    tnk_future("forward-backward-mismatched-shapes", "forward_backward", lambda c: fb(c.model_id, targets=[1, 2]),
               r"target_tokens'\] has shape \[2\]", content_type=PROTOBUF),
    tnk_future("forward-backward-unknown-model", "forward_backward", fb("s-nope:train:0"), "unknown model id",
               content_type=PROTOBUF),
    tnk_future("forward-backward-corrupt-image", "forward_backward", lambda c: fb(c.model_id, image=b"not a png"),
               "datum 0 chunk 0: cannot decode the png image", content_type=PROTOBUF),
    tnk_future("forward-backward-image-for-a-text-only-model", "forward_backward",
               lambda c: fb(c.model_id, image=TINY_PNG), "not a vision-language model", content_type=PROTOBUF),
    tnk_future("forward-backward-token-outside-vocab", "forward_backward",
               lambda c: fb(c.model_id, tokens=[5, 6, 10**6]), "outside the vocabulary", content_type=PROTOBUF),
    # ---------------------------------------------------------------- tinker: optimizer and checkpoints
    tnk("optim-step-adam-params-not-an-object", "POST", "optim_step",
        lambda c: {"model_id": c.model_id, "adam_params": [1, 2]},
        message=r"adam_params: Input should be a valid dictionary"),
    tnk("optim-step-learning-rate-not-a-number", "POST", "optim_step",
        lambda c: {"model_id": c.model_id, "adam_params": {"learning_rate": "fast"}},
        message=r"adam_params\.learning_rate: Input should be a valid number"),
    tnk("optim-step-seq-id-not-an-integer", "POST", "optim_step",
        lambda c: {"model_id": c.model_id, "seq_id": "x", "adam_params": {"learning_rate": 1e-3}},
        message=r"seq_id: Input should be a valid integer"),
    tnk_future("save-weights-path-traversal", "save_weights", lambda c: {"model_id": c.model_id, "path": "../../etc/x"},
               "invalid checkpoint name '../../etc/x'"),
    tnk_future("save-weights-absolute-path", "save_weights", lambda c: {"model_id": c.model_id, "path": c.outside},
               "invalid checkpoint name"),
    tnk("save-weights-ttl-not-a-number", "POST", "save_weights",
        lambda c: {"model_id": c.model_id, "path": "ttl-test", "ttl_seconds": "forever"},
        message=r"ttl_seconds: Input should be a valid number"),
    tnk_future("save-sampler-weights-dotdot", "save_weights_for_sampler",
               lambda c: {"model_id": c.model_id, "path": ".."}, "invalid checkpoint name '..'"),
    tnk_future("load-weights-tinker-path-with-dotdot", "load_weights",
               lambda c: {"model_id": c.model_id, "path": "tinker://../../etc/weights/x"}, "invalid checkpoint path"),
    tnk_future("load-weights-dotdot-run-and-name", "load_weights",
               lambda c: {"session_id": c.session_id, "model_seq_id": 14, "path": "tinker://../weights/.."},
               "invalid checkpoint path"),
    tnk_future("load-weights-not-a-tinker-path", "load_weights",
               lambda c: {"model_id": c.model_id, "path": "/etc/passwd"}, "invalid checkpoint path '/etc/passwd'"),
    tnk("delete-checkpoint-traversal", "DELETE", lambda c: f"training_runs/{c.model_id}/checkpoints/weights/..%2F..%2Fx",
        status=404, message="does not exist"),
    # ---------------------------------------------------------------- tinker: sampling
    tnk("create-sampling-session-path-traversal", "POST", "create_sampling_session",
        lambda c: {"session_id": c.session_id, "sampling_session_seq_id": 1,
                   "model_path": "tinker://../sampler_weights/x"}, message="invalid checkpoint path"),
    tnk_future("asample-unknown-sampling-session", "asample", asample(sampling_session_id="nope"),
               "unknown sampling session 'nope'"),
    tnk_future("asample-invalid-base64-image", "asample",
               asample(prompt={"chunks": [{"type": "image", "data": "!!!not base64", "format": "png"}]}),
               "prompt chunk 0: image data is not valid base64"),
    tnk_future("asample-negative-max-tokens", "asample", asample(sampling_params={"max_tokens": -1}),
               "max_tokens must be >= 1"),
    tnk_future("asample-prompt-longer-than-context", "asample", asample(prompt=text_prompt([7] * 5000)),
               "leaves no room in the context"),
    tnk("asample-num-samples-too-large", "POST", "asample", asample(num_samples=10**6), message="num_samples"),
    tnk("asample-num-samples-not-a-number", "POST", "asample", asample(num_samples="many"), message="num_samples"),
    tnk_future("asample-tokens-not-integers", "asample", asample(prompt=text_prompt(["a", "b"])),
               "tokens must be a list of integer"),
    tnk_future("asample-model-path-traversal", "asample", asample(model_path="tinker://../sampler_weights/x"),
               "invalid checkpoint path"),
    tnk("get-sampler-unknown", "GET", "samplers/nope", status=404, message="unknown sampler 'nope'"),
    # ---------------------------------------------------------------- tinker: futures and REST
    tnk("retrieve-future-unknown-id", "POST", "retrieve_future", {"request_id": "req-nope"}, 404,
        "unknown request id 'req-nope'"),
    tnk("training-run-unknown", "GET", "training_runs/nope", status=404, message="unknown training run"),
    tnk("list-training-runs-negative-limit", "GET", "training_runs?limit=-5", message="limit"),
]  # fmt: skip


def _ctx(row: Row, request: pytest.FixtureRequest) -> tuple[Api, Ctx]:
    """The row's server (started on first use) and what its body may refer to."""
    if row.server == "inference":
        return request.getfixturevalue("inference_without_group"), Ctx()
    model: TinkerModel = request.getfixturevalue("tinker_model")
    server: TinkerServer = request.getfixturevalue("reliability_tinker")
    outside = str(server.data_dir.parent / "outside")
    return request.getfixturevalue("tinker"), Ctx(model.session_id, model.model_id, outside)


def send(api: Api, row: Row, ctx: Ctx) -> httpx.Response:
    path = row.path(ctx) if callable(row.path) else row.path
    body = row.body(ctx) if callable(row.body) else row.body
    return api.request(row.method, path, body, content_type=row.content_type, headers=row.headers)


@pytest.fixture(scope="module")
def inference_without_group(inference: Api) -> Api:
    """The inference server without a weight-update group (another test may have left one)."""
    resp = inference.request("POST", "/destroy_weights_update_group")
    assert resp.status_code == 200, resp.text
    return inference


def test_the_table_is_big_and_covers_both_servers() -> None:
    assert len(ROWS) >= 30
    assert len({r.id for r in ROWS}) == len(ROWS)
    assert {r.server for r in ROWS} == {"inference", "tinker"}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("row", ROWS, ids=[r.id for r in ROWS])
def test_hostile_request_is_refused_with_a_clear_4xx(row: Row, request: pytest.FixtureRequest) -> None:
    api, ctx = _ctx(row, request)
    resp = send(api, row, ctx)
    if row.future:
        assert resp.status_code == 200, (resp.status_code, resp.text)
        result = tinker_result(api, resp.json()["request_id"])
        assert result.get("category") == "user", result
        message = str(result["error"])
    else:
        assert resp.status_code == row.status, (resp.status_code, resp.text)
        message = error_message(resp)
    assert re.search(row.message, message, re.IGNORECASE), message


# Checkpoint names and paths that point outside the data directory, by every route that takes one.
TRAVERSALS = [
    ("save_weights", "../../etc/x"),
    ("save_weights", "../../../../../../../../../../tmp/skylift-traversal"),
    ("save_weights", "..%2F..%2Fx"),
    ("save_weights", ".."),
    ("save_weights_for_sampler", "../../etc/x"),
    ("save_weights_for_sampler", "..\\..\\x"),
    ("save_weights_for_sampler", "."),
]


@pytest.mark.timeout(240)
def test_path_traversal_writes_nothing_outside_the_data_dir(
    tinker: Api, tinker_model: TinkerModel, reliability_tinker: TinkerServer
) -> None:
    data = reliability_tinker.data_dir
    root = data.parent
    before = sorted(root.rglob("*"))
    names = [*TRAVERSALS, ("save_weights", str(root / "outside")), ("save_weights_for_sampler", str(root))]
    for route, name in names:
        resp = tinker.request("POST", f"/api/v1/{route}", {"model_id": tinker_model.model_id, "path": name})
        assert resp.status_code == 200, resp.text
        result = tinker_result(tinker, resp.json()["request_id"])
        assert result.get("category") == "user" and "invalid checkpoint name" in result["error"], (
            name,
            result,
        )
    for route, name in [("load_weights", "tinker://../../../etc/weights/passwd")]:
        resp = tinker.request("POST", f"/api/v1/{route}", {"model_id": tinker_model.model_id, "path": name})
        result = tinker_result(tinker, resp.json()["request_id"])
        assert "invalid checkpoint path" in result["error"], result

    after = sorted(root.rglob("*"))
    outside = [p for p in after if p != root / "server.log" and not p.is_relative_to(data)]
    assert outside == [], outside
    assert not Path("/tmp/skylift-traversal").exists()
    new = [p for p in after if p not in before]
    assert not [p for p in new if p.name in ("x", "etc", "outside", "passwd")], new


@pytest.mark.timeout(300)
def test_a_tool_output_given_as_content_parts_renders(inference: Api) -> None:
    """A function_call_output with an id and a status whose output is a list of content parts (the
    schema allows it; vLLM 0.32 asserted on it, a 500) renders like the same output as a string."""
    item = {"type": "function_call_output", "call_id": "c1", "id": "o1", "status": "completed"}
    as_parts = {**item, "output": [{"type": "input_text", "text": "forty-two"}]}
    as_text = {**item, "output": "forty-two"}
    rendered = []
    for tool_output in (as_parts, as_text):
        body = {"model": TINY_SERVED_NAME, "input": [tool_output]}
        resp = inference.request("POST", "/v1/responses/render", body)
        assert resp.status_code == 200, resp.text
        rendered.append(resp.json()["token_ids"])
    assert rendered[0] == rendered[1]


def test_servers_still_serve_after_the_whole_table(request: pytest.FixtureRequest) -> None:
    for row in ROWS:  # once more, without waiting for futures: answered in time, never a 5xx
        api, ctx = _ctx(row, request)
        resp = send(api, row, ctx)
        assert resp.status_code < 500, (row.id, resp.status_code, resp.text)

    inference: Api = request.getfixturevalue("inference")
    resp = inference.request("POST", "/v1/completions", completion(max_tokens=4))
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] >= 1

    tinker: Api = request.getfixturevalue("tinker")
    model: TinkerModel = request.getfixturevalue("tinker_model")
    resp = tinker.request("POST", "/api/v1/forward_backward", fb(model.model_id), content_type=PROTOBUF)
    assert resp.status_code == 200, resp.text
    output = pb.ForwardBackwardOutput()
    output.ParseFromString(tinker_result(tinker, resp.json()["request_id"])["protobuf"])
    assert output.metrics["loss:sum"] > 0

    status = tinker.request("GET", "/skylift/status").json()
    assert status["engine_start_attempts"] == 0, status  # no hostile sample reached an engine
