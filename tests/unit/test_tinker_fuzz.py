"""schemathesis against the Tinker app's OpenAPI document (the SDK's request types describe the
JSON bodies, raw bytes the protobuf ones), in-process with a key: a bounded number of valid and
invalid examples per operation, no 5xx but 501, and the server healthy afterwards. No engine
starts: nothing generated here names a sampler that exists.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable

from skylift.tinker.app import create_app
from skylift.tinker.service import ServerConfig

EXAMPLES = 5  # per operation and generation mode
HEADERS = {"X-API-Key": "tml-dummy"}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TestClient]:
    tmp = tmp_path_factory.mktemp("tinker-fuzz")
    config = ServerConfig(
        base_models=[str(tiny_model_dir)],
        db_url=f"sqlite:///{tmp / 'tinker.db'}",
        data_dir=tmp / "data",
        max_model_len=64,
        max_request_mb=4.0,
    )
    with TestClient(create_app(config), raise_server_exceptions=False) as c:
        yield c


def _send(client: TestClient, case: Any) -> int:
    kwargs = case.as_transport_kwargs(base_url="http://testserver", headers=HEADERS)
    kwargs.pop("cookies", None)
    if kwargs.get("data") is not None:
        kwargs["content"] = kwargs.pop("data")
    return int(client.request(kwargs.pop("method"), kwargs.pop("url"), **kwargs).status_code)


def test_fuzzed_requests_get_no_server_errors(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    assert doc["paths"]["/api/v1/create_model"]["post"]["requestBody"]  # the SDK's types describe bodies
    schema = schemathesis.openapi.from_dict(doc)
    errors: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        op = result.ok()
        operations += 1
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                database=None,
                phases=[Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case: Any) -> None:
                status = _send(client, case)
                if status >= 500 and status != 501:
                    errors.append(f"{case.method} {case.formatted_path}: {status} for {case.body!r:.300}")

            try:
                run()
            except Unsatisfiable:  # an operation without anything to make invalid
                pass
    assert operations >= 35, operations
    assert errors == [], "\n".join(errors[:20])
    assert client.get("/api/v1/healthz").json() == {"status": "ok"}
    session = client.post("/api/v1/create_session", json={"tags": []}, headers=HEADERS)
    assert session.status_code == 200 and session.json()["session_id"], session.text
