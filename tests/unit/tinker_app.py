"""The in-process Tinker app the limit tests share (tests/unit/test_tinker_limits.py and
test_tinker_shared_state.py): two users, small limits, no engine ever started."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from skylift.tinker.app import create_app
from skylift.tinker.service import ServerConfig

API = "/api/v1"
ALICE, BOB = {"X-API-Key": "tml-alice"}, {"X-API-Key": "tml-bob"}
MAX_LEN = 64
MAX_MB = 1.0
CELLS = 100_000


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TestClient]:
    """One app with two users, a 1 MiB body limit, 100k loss cells and a 64-token context."""
    tmp = tmp_path_factory.mktemp("tinker-limits")
    keys = tmp / "keys"
    keys.write_text("alice tml-alice\nbob tml-bob\n")
    media = tmp / "media"
    media.mkdir()
    config = ServerConfig(
        base_models=[str(tiny_model_dir)],
        db_url=f"sqlite:///{tmp / 'tinker.db'}",
        data_dir=tmp / "data",
        api_keys_file=keys,
        max_model_len=MAX_LEN,
        max_request_mb=MAX_MB,
        max_request_cells=CELLS,
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as client:
        client.tiny_model_dir = tiny_model_dir  # type: ignore[attr-defined]
        yield client


def session(client: TestClient, headers: dict[str, str]) -> str:
    resp = client.post(f"{API}/create_session", json={"tags": []}, headers=headers)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["session_id"])


def result(client: TestClient, request_id: str, headers: dict[str, str]) -> dict[str, Any]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        resp = client.post(f"{API}/retrieve_future", json={"request_id": request_id}, headers=headers)
        if resp.status_code != 408:
            assert resp.status_code == 200, resp.text
            return dict(resp.json())
    raise AssertionError(f"future {request_id} did not finish")


def healthy(client: TestClient) -> None:
    assert client.get(f"{API}/healthz").json() == {"status": "ok"}
    assert client.get(f"{API}/training_runs", headers=ALICE).status_code == 200


def png() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (1, 2, 3)).save(buf, "PNG")
    return buf.getvalue()


def tensor(values: list[int] | None = None, shape: list[int] | None = None, **sparse: bytes) -> pb.Tensor:
    if sparse:
        return pb.Tensor(dtype=pb.DTYPE_INT64, shape=shape or [], sparse_csr=pb.SparseCsr(**sparse))
    data = np.asarray(values or [], dtype="<i8").tobytes()
    return pb.Tensor(dense=data, dtype=pb.DTYPE_INT64, shape=shape or [len(values or [])])


def fb(model_id: str, tokens: list[int], targets: pb.Tensor | None = None) -> bytes:
    datum = pb.Datum()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens, dtype="<i4").tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(targets if targets is not None else tensor(tokens))
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    msg.data.append(datum)
    return msg.SerializeToString()


def sampler(client: TestClient) -> str:
    body = {
        "session_id": session(client, ALICE),
        "sampling_session_seq_id": 0,
        "base_model": str(client.tiny_model_dir),  # type: ignore[attr-defined]
    }
    resp = client.post(f"{API}/create_sampling_session", json=body, headers=ALICE)
    assert resp.status_code == 200, resp.text
    return str(resp.json()["sampling_session_id"])
