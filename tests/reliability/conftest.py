"""The two servers every reliability test talks to, one of each for the whole folder (and session).

- Inference: `tiny_server_with_key` from tests/conftest.py (`skylift serve` on the tiny model with
  an API key, started without --host), shared with tests/integration when both run.
- Tinker: `reliability_tinker`, one `skylift tinker serve` on the tiny model with an API key,
  started without --host. Its data directory is `<root>/data` in a root of its own, so tests can
  check that nothing is ever written beside it. It never starts an inference engine: no test here
  samples successfully.

Run inside a loopback-only namespace: bash scripts/loopback.sh .venv/bin/pytest tests/reliability
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from reliability_helpers import TINKER_API_KEY, Api, TinkerModel, tinker_result
from server_helpers import ServerHandle, TinkerServer, require_loopback_namespace


@pytest.fixture(scope="session")
def reliability_tinker(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[TinkerServer]:
    """One keyed Tinker server for the session; its data lives in `<root>/data`, its log in `<root>`."""
    require_loopback_namespace()
    root = tmp_path_factory.mktemp("reliability-tinker")
    server = TinkerServer(
        data_dir=root / "data",
        log_path=root / "server.log",
        host=None,  # the default bind; test_auth checks that it is loopback
        # sessions outlive slow runs: the tests send no heartbeats
        extra_args=["--api-key", TINKER_API_KEY, "--long-poll", "2", "--session-timeout", "3600"],
    )
    with server:
        yield server


@pytest.fixture(scope="session")
def inference(tiny_server_with_key: ServerHandle) -> Api:
    """The keyed inference server, with its key."""
    return Api(tiny_server_with_key.url, {"Authorization": f"Bearer {tiny_server_with_key.api_key}"})


@pytest.fixture(scope="session")
def tinker(reliability_tinker: TinkerServer) -> Api:
    """The keyed Tinker server, with its key."""
    return Api(reliability_tinker.url, {"X-API-Key": TINKER_API_KEY})


@pytest.fixture(scope="session")
def tinker_model(tinker: Api) -> TinkerModel:
    resp = tinker.request(
        "POST", "/api/v1/create_session", {"tags": [], "user_metadata": {}, "sdk_version": "x"}
    )
    assert resp.status_code == 200, resp.text
    session_id = resp.json()["session_id"]
    body = {
        "session_id": session_id,
        "model_seq_id": 0,
        "base_model": "tiny-qwen2",
        "lora_config": {"rank": 4},
    }
    resp = tinker.request("POST", "/api/v1/create_model", body)
    assert resp.status_code == 200, resp.text
    result = tinker_result(tinker, resp.json()["request_id"], timeout_s=300)
    assert "error" not in result, result
    return TinkerModel(session_id=session_id, model_id=result["model_id"])
