"""The protobuf bodies of /forward and /forward_backward go through typed models
(skylift.tinker.core.wire_bodies) like the JSON bodies: a malformed field is a 400 naming it, at
once, before any tensor is made dense; a good body decodes as before. Directly through
`decode_forward_backward` and once through the real app in-process (no engine)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from skylift.tinker.app import create_app
from skylift.tinker.core.wire import decode_forward_backward
from skylift.tinker.core.wire_bodies import MAX_NAMES
from skylift.tinker.errors import UserError
from skylift.tinker.service import ServerConfig

API = "/api/v1"
KEY = {"X-API-Key": "tml-x", "Content-Type": "application/x-protobuf"}
TOKENS = [5, 6, 7]


def request(edit: Callable[[pb.ForwardBackwardRequest], None] | None = None) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id="s-x:train:0", seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(TOKENS, dtype="<i4").tobytes()
    targets = datum.loss_fn_inputs["target_tokens"]
    targets.dtype, targets.dense = pb.DTYPE_INT64, np.asarray(TOKENS, dtype="<i8").tobytes()
    targets.shape.extend([len(TOKENS)])
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype, weights.dense = pb.DTYPE_FLOAT32, np.ones(3, dtype="<f4").tobytes()
    weights.shape.extend([3])
    msg.loss_fn_config["clip_low"] = 0.2
    msg.loss_fn_config_v2["mode"].text = "sum"
    if edit is not None:
        edit(msg)
    return msg.SerializeToString()


def targets(msg: pb.ForwardBackwardRequest) -> pb.Tensor:
    return msg.data[0].loss_fn_inputs["target_tokens"]


def test_a_good_body_decodes_into_tokens_tensors_and_config() -> None:
    call = decode_forward_backward(request())
    assert (call.model_id, call.seq_id, call.loss_fn, call.forward_only) == (
        "s-x:train:0",
        1,
        "cross_entropy",
        False,
    )
    assert call.loss_fn_config == {"clip_low": pytest.approx(0.2), "mode": "sum"}
    (datum,) = call.data
    assert datum.tokens == TOKENS
    assert (
        datum.inputs["target_tokens"].tolist() == TOKENS and datum.inputs["target_tokens"].dtype == np.int64
    )
    assert datum.inputs["weights"].tolist() == [1.0, 1.0, 1.0]
    assert call.error is None


def _set_shape(shape: list[int]) -> Callable[[pb.ForwardBackwardRequest], None]:
    def edit(msg: pb.ForwardBackwardRequest) -> None:
        del targets(msg).shape[:]
        targets(msg).shape.extend(shape)

    return edit


def _many_inputs(msg: pb.ForwardBackwardRequest) -> None:
    for i in range(MAX_NAMES + 1):
        msg.data[0].loss_fn_inputs[f"x{i}"].dtype = pb.DTYPE_FLOAT32


def _sparse_1d(msg: pb.ForwardBackwardRequest) -> None:
    targets(msg).sparse_csr.crow_indices = np.zeros(2, dtype="<i8").tobytes()


def _span(msg: pb.ForwardBackwardRequest) -> None:
    span = msg.data[0].loss_fn_input_spans.add()
    span.sampled_tokens.sequence_id, span.sampled_tokens.offset = "s", -3


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda m: setattr(m, "seq_id", -1), "seq_id: Input should be greater than or equal to 0"),
        (
            lambda m: setattr(m, "model_id", "m" * 5000),
            "model_id: String should have at most 1024 characters",
        ),
        (lambda m: setattr(m, "loss_fn", "l" * 500), "loss_fn: String should have at most 128 characters"),
        (lambda m: m.loss_fn_config.__setitem__("clip_low", float("nan")), "loss_fn_config.clip_low"),
        (lambda m: setattr(targets(m), "dtype", pb.DTYPE_BFLOAT16), "unsupported tensor dtype 4"),
        (
            _set_shape([-3]),
            "data.0.loss_fn_inputs.target_tokens.shape.0: Input should be greater than or equal to 0",
        ),
        (
            _set_shape([1, 1, 3]),
            "data.0.loss_fn_inputs.target_tokens.shape: List should have at most 2 items",
        ),
        (
            lambda m: setattr(targets(m), "dense", b"\x01\x02\x03"),
            "dense: 3 bytes are not a whole number of int64",
        ),
        (_sparse_1d, "a sparse CSR tensor needs a 2-D shape, got [3]"),
        (
            lambda m: setattr(m.data[0].model_input[0].encoded_text, "tokens", b"\x01\x02\x03"),
            "data.0.model_input.0: Value error, tokens: 3 bytes are not a whole number of int32",
        ),
        (_many_inputs, "data.0.loss_fn_inputs: Dictionary should have at most 64 items"),
        (_span, "data.0.loss_fn_input_spans.0.offset: Input should be greater than or equal to 0"),
    ],
)
def test_a_malformed_field_is_refused_naming_it(
    edit: Callable[[pb.ForwardBackwardRequest], None], expected: str
) -> None:
    with pytest.raises(UserError, match="forward_backward: malformed request") as caught:
        decode_forward_backward(request(edit))
    assert expected in str(caught.value), str(caught.value)


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TestClient]:
    tmp = tmp_path_factory.mktemp("tinker-wire-bodies")
    config = ServerConfig(
        base_models=[str(tiny_model_dir)], db_url=f"sqlite:///{tmp / 'w.db'}", data_dir=tmp / "data"
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as c:
        yield c


def test_both_routes_answer_a_malformed_protobuf_field_with_a_400(client: TestClient) -> None:
    for route in ("forward", "forward_backward"):
        resp = client.post(f"{API}/{route}", content=request(_set_shape([-3])), headers=KEY)
        assert resp.status_code == 400, (route, resp.text)
        assert "target_tokens.shape.0: Input should be greater than or equal to 0" in resp.json()["error"]
        ok = client.post(
            f"{API}/{route}", content=request(), headers=KEY
        )  # an unknown model: a failed future
        assert ok.status_code == 200 and "request_id" in ok.json(), ok.text
    assert client.get(f"{API}/healthz").json() == {"status": "ok"}
