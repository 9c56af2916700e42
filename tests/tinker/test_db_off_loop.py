"""The Tinker service never touches its database on an event loop.

The real app runs in this process (uvicorn on loopback, in a thread) with every `Store` method
watched: a call made from a thread that is running an event loop is recorded. One user then goes
through every kind of operation (training, checkpoints in and out, sampler sessions, a sample
whose engine refuses to start, an ephemeral sampler save, listings, finishing the session, the
stale-session sweep and the result pruning run in the background), and no store call may have
been made on a loop. A store call there stalls every other request of every user for as long as
the database takes (a PostgreSQL round trip, a SQLite write lock held by another writer).
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from lab_helpers import Lab, fb_body, write_keys
from server_helpers import TINY_MAX_MODEL_LEN, TINY_SERVED_NAME, require_loopback_namespace

from skylift.tinker.app import create_app
from skylift.tinker.sampling.engine_host import FAIL_START_ENV
from skylift.tinker.service import ServerConfig
from skylift.tinker.storage.store import Store

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-loop"}


def _on_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def _watched(name: str, fn: Callable[..., Any], on_loop: list[str]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _on_loop():
            on_loop.append(f"{name} (thread {threading.current_thread().name})")
        return fn(*args, **kwargs)

    return call


@pytest.fixture
def watched_server(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Lab, list[str]]]:
    require_loopback_namespace()
    assert tiny_model_dir.is_dir()
    on_loop: list[str] = []
    for name, fn in list(vars(Store).items()):
        if callable(fn) and not name.startswith("__"):
            monkeypatch.setattr(Store, name, _watched(name, fn, on_loop))
    monkeypatch.setenv(FAIL_START_ENV, "1")  # a sample runs up to the engine, which never starts
    keys_file = tmp_path / "keys.txt"
    write_keys(keys_file, KEYS)
    config = ServerConfig(
        base_models=[TINY_SERVED_NAME],
        db_url=f"sqlite:///{tmp_path / 'tinker.db'}",
        data_dir=tmp_path / "data",
        api_keys_file=keys_file,
        result_retention_s=1.0,
        max_model_len=TINY_MAX_MODEL_LEN,
        cleanup_interval_s=0.5,
        long_poll_s=2.0,
    )
    server = uvicorn.Server(uvicorn.Config(create_app(config), host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the in-process server did not start"
        time.sleep(0.1)
    port = server.servers[0].sockets[0].getsockname()[1]
    lab = Lab(f"http://127.0.0.1:{port}", dict(KEYS))
    try:
        yield lab, on_loop
    finally:
        lab.http.close()
        server.should_exit = True
        thread.join(timeout=120)
    assert not thread.is_alive(), "the in-process server did not stop"


def test_no_store_call_runs_on_an_event_loop(watched_server: tuple[Lab, list[str]]) -> None:
    lab, on_loop = watched_server
    user = "alice"
    rec = lab.build_records(user, TINY_SERVED_NAME)
    model = rec.model_id
    assert lab.post(user, "session_heartbeat", {"session_id": rec.session_id}).status_code == 200
    assert lab.post(user, "get_info", {"model_id": model}).status_code == 200
    # training with the checkpoints just written, and exports
    lab.ok(user, "load_weights", {"model_id": model, "seq_id": 5, "path": rec.state_path})
    lab.ok(user, "forward", fb_body(model, seq_id=6))
    ext = lab.ok(user, "save_weights_external", {"model_id": model, "seq_id": 7, "path": "ext"})
    ephemeral = {"model_id": model, "seq_id": 8, "sampling_session_seq_id": 1}
    sampler_id = lab.ok(user, "save_weights_for_sampler", ephemeral)["sampling_session_id"]
    created = {"session_id": rec.session_id, "model_seq_id": 1, "path": rec.state_path}
    copy = lab.ok(user, "load_weights", created)["model_id"]
    # samples: each reads its sampler's record and checkpoint, then the engine refuses to start
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [5, 6, 7]}]}
    for target in (
        {"sampling_session_id": rec.sampler_id, "record_stability_info": True},
        {"sampling_session_id": sampler_id},
        {"model_path": rec.sampler_path},
    ):
        body = {**target, "prompt": prompt, "num_samples": 1, "sampling_params": {"max_tokens": 2}}
        failed = lab.failure(user, "asample", body)
        assert "engine start-up refused" in failed["error"], failed
    # the REST views
    views = ("training_runs", f"training_runs/{model}", f"training_runs/{model}/checkpoints", "checkpoints")
    for path in (*views, "sessions", f"sessions/{rec.session_id}"):
        assert lab.call(user, "GET", path).status_code == 200, path
    assert lab.post(user, "weights_info", {"tinker_path": rec.state_path}).status_code == 200
    run_ckpt = f"training_runs/{model}/checkpoints/{ext['path'].split('/', 3)[3]}"
    assert lab.call(user, "POST", f"{run_ckpt}/publish").status_code == 204
    assert lab.call(user, "DELETE", f"training_runs/{model}/checkpoints/weights/state").status_code == 200
    # finishing the session releases both models; an operation of a released model is refused
    finish = lab.post(user, f"sessions/{rec.session_id}/finish", {"reason": {"type": "success"}})
    assert finish.status_code == 200, finish.text
    refused = lab.failure(user, "optim_step", {"model_id": copy, "seq_id": 1, "adam_params": {}})
    assert "not loaded" in refused["error"], refused
    time.sleep(1.5)  # a few stale-session sweeps and result prunings
    assert not on_loop, f"store methods called on an event loop: {sorted(set(on_loop))}"
