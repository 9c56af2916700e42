"""The Tinker routes' typed bodies (skylift.tinker.core.bodies): their limits are published in the
OpenAPI document, a body past one is a 400 naming the field, and a malformed operation on a
model the caller does not own answers like an unknown model (no hint about its shape)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from skylift.tinker.app import create_app
from skylift.tinker.core.bodies import MAX_SEQ_ID, MAX_TAGS
from skylift.tinker.sampling.bodies import SampleBody
from skylift.tinker.service import ServerConfig

API = "/api/v1"
KEY = {"X-API-Key": "tml-x"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TestClient]:
    tmp = tmp_path_factory.mktemp("tinker-bodies")
    config = ServerConfig(
        base_models=[str(tiny_model_dir)], db_url=f"sqlite:///{tmp / 'b.db'}", data_dir=tmp / "data"
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as c:
        yield c


def test_the_openapi_document_publishes_the_declared_limits(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    schemas = doc["components"]["schemas"]
    ref = doc["paths"][f"{API}/asample"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert ref == {"$ref": "#/components/schemas/SampleBody"}
    sample = schemas["SampleBody"]["properties"]
    assert sample["num_samples"]["maximum"] == SampleBody.model_fields["num_samples"].metadata[1].le == 256
    assert schemas["CreateModelBody"]["properties"]["model_seq_id"]["maximum"] == MAX_SEQ_ID
    assert schemas["CreateSessionBody"]["properties"]["tags"]["maxItems"] == MAX_TAGS
    binary = doc["paths"][f"{API}/forward_backward"]["post"]["requestBody"]["content"]
    assert "application/octet-stream" in binary


def test_a_body_past_a_limit_is_a_400_naming_the_field(client: TestClient) -> None:
    resp = client.post(f"{API}/create_session", json={"tags": ["t"] * (MAX_TAGS + 1)}, headers=KEY)
    assert resp.status_code == 400 and "tags" in resp.json()["error"], resp.text
    resp = client.post(f"{API}/asample", json={"base_model": "x", "num_samples": 257}, headers=KEY)
    assert resp.status_code == 400 and "num_samples" in resp.json()["error"], resp.text
    resp = client.post(f"{API}/asample", json={"base_model": "x", "topk_sample_logprobs": 21}, headers=KEY)
    assert resp.status_code == 400 and "above this server's cap of 20" in resp.json()["error"], resp.text
    resp = client.post(f"{API}/get_info", json={"model_id": "m" * 5000}, headers=KEY)
    assert resp.status_code == 400 and "model_id" in resp.json()["error"], resp.text


def test_a_malformed_operation_on_an_unknown_model_answers_like_an_unknown_model(client: TestClient) -> None:
    bad = {"model_id": "s-nobody:train:0", "seq_id": "first", "adam_params": {"learning_rate": "fast"}}
    resp = client.post(f"{API}/optim_step", json=bad, headers=KEY)
    assert resp.status_code == 200, resp.text
    request_id = resp.json()["request_id"]
    for _ in range(100):
        got = client.post(f"{API}/retrieve_future", json={"request_id": request_id}, headers=KEY)
        if got.status_code != 408:
            break
    assert got.status_code == 200 and "unknown model id" in got.json()["error"], got.text
    # without a usable model id it is a 400 naming the field
    resp = client.post(f"{API}/optim_step", json={"seq_id": 1}, headers=KEY)
    assert resp.status_code == 400 and "model_id" in resp.json()["error"], resp.text
