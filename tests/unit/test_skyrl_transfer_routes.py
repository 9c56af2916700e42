"""The body-less routes of vLLM's weight-transfer protocol (`skylift.compat.skyrl.routes`), over a
fake engine client: 501 naming the route on CPU; on a GPU the engine client's method of the route's
name, and vLLM's answer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from skylift.compat.skyrl.routes import router

ROUTES = {
    "start_weight_update": "Weight update started",
    "start_draft_weight_update": "Draft weight update started",
    "shutdown_weight_transfer_engine": "Weight transfer shut down",
}


class RecordingEngine:
    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str):  # noqa: ANN204
        async def call() -> None:
            self.calls.append(name)

        return call


def _client(platform: str) -> tuple[TestClient, RecordingEngine]:
    app = FastAPI()
    app.include_router(router)
    engine = RecordingEngine()
    app.state.engine_client = engine
    app.state.skylift = SimpleNamespace(platform=platform)
    return TestClient(app), engine


@pytest.mark.parametrize("name", list(ROUTES))
def test_on_cpu_a_transfer_route_is_501_naming_itself(name: str) -> None:
    client, engine = _client("cpu")
    answer = client.post(f"/{name}")
    assert answer.status_code == 501
    assert answer.json()["detail"].startswith(f"/{name} is not available on CPU")
    assert engine.calls == []


@pytest.mark.parametrize("name", list(ROUTES))
def test_on_a_gpu_a_transfer_route_calls_the_engine_method_of_its_name(name: str) -> None:
    client, engine = _client("cuda")
    answer = client.post(f"/{name}")
    assert answer.status_code == 200
    assert answer.json() == {"message": ROUTES[name]}
    assert engine.calls == [name]
