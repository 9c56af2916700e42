"""Raw-HTTP helpers for the multi-user Tinker tests (test_users*.py, test_postgres*.py, test_restart*.py).

`Lab` talks to one `skylift tinker serve --api-keys-file` server as any of its users; `build_records`
gives a user a session, a trained LoRA model, a training and a sampler checkpoint and a sampler,
without ever starting an inference engine.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from server_helpers import TINY_SERVED_NAME
from sqlalchemy import create_engine, text
from tinker.proto import tinker_public_pb2 as pb

from skylift.tinker.storage.db.local_postgres import LocalPostgres, find_bin_dir
from skylift.tinker.storage.db.migrate import upgrade
from skylift.tinker.training.trained_model import ModelConfig

API = "/api/v1"
RESULT_TIMEOUT_S = 120.0
LEGACY_SQL = Path(__file__).parent / "data" / "schema_before_migrations.sql"
T0 = "2026-01-02 03:04:05"


def postgres_cluster() -> Iterator[LocalPostgres]:
    """A throw-away PostgreSQL cluster (fixture body); skipped without the server binaries, except
    in CI (CI=true), where their absence fails the test."""
    if find_bin_dir() is None:
        message = "PostgreSQL server binaries not found (apt-get install -y postgresql)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{message}; CI must have them (.ci/run installs the package)")
        pytest.skip(message)
    cluster = LocalPostgres().start()
    try:
        yield cluster
    finally:
        cluster.stop()


def _legacy_rows(model_path: str) -> list[tuple[str, dict]]:
    """One record of every table, as the code before migrations wrote them."""
    config = ModelConfig(base_model=TINY_SERVED_NAME, model_path=model_path, lora_rank=4).to_json()
    return [
        ("INSERT INTO tinker_sessions (id, created_at, last_heartbeat, tags, user_metadata, sdk_version)"
         " VALUES ('s-old', :t, :t, '[\"x\"]', '{}', '0.38.0')", {}),
        ("INSERT INTO tinker_models (model_id, session_id, base_model, config, status, created_at, last_request_time)"
         " VALUES ('s-old:train:0', 's-old', :base, :config, 'ready', :t, :t)",
         {"base": TINY_SERVED_NAME, "config": json.dumps(config)}),
        ("INSERT INTO tinker_futures (request_id, kind, model_id, dedup_key, status, created_at)"
         " VALUES ('req-old', 'optim_step', 's-old:train:0', 'op:s-old:train:0:3', 'pending', :t)", {}),
        ("INSERT INTO tinker_sampling_sessions (id, session_id, base_model, source, created_at)"
         " VALUES ('s-old:sample:0', 's-old', :base, 'base', :t)", {"base": TINY_SERVED_NAME}),
        ("INSERT INTO tinker_checkpoints (tinker_path, model_id, checkpoint_id, kind, directory, size_bytes, created_at)"
         " VALUES ('tinker://s-old:train:0/weights/w1', 's-old:train:0', 'weights/w1', 'training', '/nowhere', 123456789, :t)",
         {}),
    ]  # fmt: skip


def _write_legacy(url: str, model_path: str, sqlite_file: Path | None = None) -> None:
    if sqlite_file is not None:  # the CREATE statements of that time, verbatim
        with sqlite3.connect(sqlite_file) as db:
            db.executescript(LEGACY_SQL.read_text())
    else:  # PostgreSQL: the frozen first revision creates the same tables
        engine = create_engine(url)
        upgrade(engine, "0001")
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE alembic_version"))  # as before migrations existed
        engine.dispose()
    engine = create_engine(url)
    with engine.begin() as conn:
        for sql, params in _legacy_rows(model_path):
            conn.execute(text(sql), {"t": T0, **params})
    engine.dispose()


def write_legacy(url: str, model_path: str, sqlite_file: Path | None = None) -> None:
    """A database as skylift wrote it before migrations: the tables (SQLite: the CREATE statements
    of that time, verbatim; PostgreSQL: the frozen revision 0001, without alembic_version) and one
    record in each (a run `s-old:train:0` of user "default" with checkpoint `.../weights/w1`,
    a pending future `req-old`)."""
    if sqlite_file is not None:
        with sqlite3.connect(sqlite_file) as db:
            db.executescript(LEGACY_SQL.read_text())
    else:
        engine = create_engine(url)
        upgrade(engine, "0001")
        with engine.begin() as conn:
            conn.execute(text("DROP TABLE alembic_version"))
        engine.dispose()
    engine = create_engine(url)
    with engine.begin() as conn:
        for sql, params in _legacy_rows(model_path):
            conn.execute(text(sql), {"t": T0, **params})
    engine.dispose()


def write_keys(path: Path, users: dict[str, str]) -> None:
    lines = ["# user key"] + [f"{user} {key}" for user, key in users.items()]
    path.write_text("\n".join(lines) + "\n")


def fb_body(model_id: str, seq_id: int = 0, tokens: list[int] | None = None) -> bytes:
    """A ForwardBackwardRequest protobuf with one next-token datum."""
    tokens = tokens or [5, 6, 7, 8, 9, 10]
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(tokens[:-1], dtype="<i4").tobytes()
    target = np.asarray(tokens[1:], dtype=np.int64)
    datum.loss_fn_inputs["target_tokens"].CopyFrom(
        pb.Tensor(dense=target.tobytes(), dtype=pb.DTYPE_INT64, shape=[len(target)])
    )
    return msg.SerializeToString()


@dataclass
class Records:
    """What one user created."""

    session_id: str
    model_id: str
    state_path: str
    sampler_path: str
    sampler_id: str
    request_id: str  # a finished future of the user


class Lab:
    def __init__(self, url: str, keys: dict[str, str]) -> None:
        self.url = url
        self.keys = keys
        self.http = httpx.Client(base_url=url, timeout=60)

    def call(self, user: str, method: str, path: str, body: Any = None, **kw: Any) -> httpx.Response:
        headers = {"X-API-Key": self.keys[user], **kw.pop("headers", {})}
        if isinstance(body, bytes):
            headers["Content-Type"] = "application/x-protobuf"
            kw["content"] = body
        else:
            kw["json"] = body
        try:
            return self.http.request(method, f"{API}/{path}", headers=headers, **kw)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # uvicorn closes a keep-alive connection after a 500 from an exception handler; a
            # request sent on it just then is reset unread. The SDK retries such errors; so do we,
            # once, on a fresh connection.
            return self.http.request(method, f"{API}/{path}", headers=headers, **kw)

    def post(self, user: str, path: str, body: Any = None) -> httpx.Response:
        return self.call(user, "POST", path, body if body is not None else {})

    def result(self, user: str, request_id: str, timeout_s: float = RESULT_TIMEOUT_S) -> httpx.Response:
        """The final answer of retrieve_future (not 408)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            resp = self.post(user, "retrieve_future", {"request_id": request_id})
            if resp.status_code != 408:
                return resp
        raise AssertionError(f"future {request_id} did not finish in {timeout_s:.0f} s")

    def ok(self, user: str, path: str, body: Any = None) -> dict[str, Any]:
        """POST an operation and return its successful JSON result."""
        resp = self.post(user, path, body)
        assert resp.status_code == 200, (path, resp.status_code, resp.text)
        done = self.result(user, resp.json()["request_id"])
        assert done.status_code == 200, (path, done.status_code, done.text)
        if "protobuf" in done.headers.get("content-type", ""):
            return {"protobuf": done.content}
        assert "error" not in done.json(), (path, done.text)
        return done.json()

    def failure(self, user: str, path: str, body: Any = None) -> dict[str, Any]:
        """POST an operation that is accepted and whose future fails; its {"error", "category"}."""
        resp = self.post(user, path, body)
        assert resp.status_code == 200, (path, resp.status_code, resp.text)
        done = self.result(user, resp.json()["request_id"])
        assert done.status_code == 200 and "error" in done.json(), (path, done.status_code, done.text)
        return done.json()

    def session(self, user: str) -> str:
        resp = self.post(user, "create_session", {"tags": [], "user_metadata": {}, "sdk_version": "test"})
        assert resp.status_code == 200, resp.text
        return resp.json()["session_id"]

    def build_records(self, user: str, base_model: str) -> Records:
        session_id = self.session(user)
        create = {
            "session_id": session_id,
            "model_seq_id": 0,
            "base_model": base_model,
            "lora_config": {"rank": 4},
        }
        model_id = self.ok(user, "create_model", create)["model_id"]
        fb = self.post(user, "forward_backward", fb_body(model_id, seq_id=1))
        assert fb.status_code == 200, fb.text
        self.ok(
            user, "optim_step", {"model_id": model_id, "seq_id": 2, "adam_params": {"learning_rate": 1e-3}}
        )
        assert self.result(user, fb.json()["request_id"]).status_code == 200
        state = self.ok(user, "save_weights", {"model_id": model_id, "seq_id": 3, "path": "state"})["path"]
        sampler = self.ok(
            user, "save_weights_for_sampler", {"model_id": model_id, "seq_id": 4, "path": "sampler"}
        )
        body = {"session_id": session_id, "sampling_session_seq_id": 0, "model_path": sampler["path"]}
        resp = self.post(user, "create_sampling_session", body)
        assert resp.status_code == 200, resp.text
        return Records(
            session_id=session_id,
            model_id=model_id,
            state_path=state,
            sampler_path=sampler["path"],
            sampler_id=resp.json()["sampling_session_id"],
            request_id=fb.json()["request_id"],
        )
