"""The generic weight route, ``POST /skylift/weights/{transport}/{operation}`` (`inference.routes`),
over a real `LocalVLLMEngine` on a fake vLLM (`test_delta_engines.Engine`): the answer is the
engine side's, bad requests are 4xx naming what was wrong, and the delta side's paths are checked
against the server's roots as on its own routes."""

from __future__ import annotations

from pathlib import Path

from delta_fakes import sent, step, tiny_model
from fastapi import FastAPI
from fastapi.testclient import TestClient
from test_delta_engines import Engine

from skylift.inference import routes
from skylift.inference.allowed_paths import AllowedRoots
from skylift.weight_sync.delta.publish import DeltaPublisher


def test_every_transport_operation_behind_one_route(tmp_path: Path) -> None:
    base, sync = tmp_path / "base", tmp_path / "sync"
    model = tiny_model(base)
    engine = Engine("server", base)
    app = FastAPI()
    roots = AllowedRoots.from_flags([str(tmp_path)])
    app.state.skylift = type("State", (), {"engine": engine, "delta_roots": roots, "api_key_hashes": []})()
    app.include_router(routes.router)
    client = TestClient(app)
    step(model, ["lm_head.weight"], seed=1)
    DeltaPublisher(sync, base).publish(sent(model))
    body = {"version": 1, "sync_dir": str(sync), "local_checkpoint_dir": str(tmp_path / "store")}
    loaded = client.post("/skylift/weights/delta/load", json=body)
    assert loaded.status_code == 200 and loaded.json()["result"]["version"] == 1, loaded.text
    assert engine.fake.holds(model)
    answer = client.post("/skylift/weights/delta/fetch")  # no body: an empty payload
    assert answer.status_code == 400 and "fetch_delta: bad payload" in answer.text
    bad = {
        "no such transport": (
            "/skylift/weights/carrier-pigeon/load",
            {},
            404,
            "no weight transport 'carrier-pigeon'",
        ),
        "no such operation": ("/skylift/weights/delta/teleport", {}, 404, "has no operation 'teleport'"),
        "a payload that does not fit": ("/skylift/weights/delta/load", {"colour": 1}, 400, "bad payload"),
        "a path outside the roots": (
            "/skylift/weights/delta/fetch",
            {**body, "sync_dir": str(tmp_path.parent)},
            403,
            "not under an allowed",
        ),
        "a path that is no string": (
            "/skylift/weights/delta/fetch",
            {**body, "sync_dir": 7},
            400,
            "must be a string",
        ),
        "not an object": ("/skylift/weights/delta/fetch", [1, 2], 400, "must be a JSON object"),
        "no group": ("/skylift/weights/broadcast/stream", {}, 409, "no weight-update group"),
    }
    for what, (path, payload, status, words) in bad.items():
        answer = client.post(path, json=payload)
        assert answer.status_code == status and words in answer.text, (what, answer.status_code, answer.text)
    assert client.post("/skylift/weights/delta/load", content=b"{nope").status_code == 400
    assert engine.fake.holds(model)  # nothing a bad request did changed the weights
