"""A Tinker server shared by users (--api-keys-file): each sees and touches only its own records,
another user's ids and paths answer exactly like unknown ones, SIGHUP revokes a key at once; and
the server strands no work (a finished session's queued operations fail at once, retrieved
results are pruned, the database is used off the event loop, internal failures are server errors).

One server for the module (no inference engine ever starts: everything here is training, sampler
sessions and refusals); three users train at once through the SDK.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import tinker
from lab_helpers import Lab, Records, fb_body, write_keys, write_legacy
from server_helpers import TINY_SERVED_NAME, TinkerServer, require_loopback_namespace
from tinker import types
from tinker_helpers import logprobs_of, sft_dataset

pytestmark = pytest.mark.integration

KEYS = {"alice": "tml-alice-1", "bob": "tml-bob-1", "dave": "tml-dave-1", "default": "tml-default-1"}
RETENTION_S = 3


@pytest.fixture(scope="module")
def lab_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TinkerServer]:
    require_loopback_namespace()
    tmp = tmp_path_factory.mktemp("tinker-users")
    keys_file = tmp / "keys.txt"
    write_keys(keys_file, KEYS)
    (tmp / "data").mkdir()  # a data directory from before users and migrations: the server upgrades it
    write_legacy(
        f"sqlite:///{tmp / 'data' / 'tinker.db'}",
        os.path.realpath(tiny_model_dir),
        tmp / "data" / "tinker.db",
    )
    server = TinkerServer(
        data_dir=tmp / "data",
        log_path=tmp / "server.log",
        extra_args=[
            "--api-keys-file",
            str(keys_file),
            "--result-retention-s",
            str(RETENTION_S),
            "--long-poll",
            "2",
        ],
        env={"SKYLIFT_TINKER_FAIL_ENGINE_START": "1"},
    )
    server.keys_file = keys_file  # type: ignore[attr-defined]
    with server:
        yield server


@pytest.fixture(scope="module")
def lab(lab_server: TinkerServer) -> Lab:
    return Lab(lab_server.url, dict(KEYS))


@pytest.fixture(scope="module")
def alice(lab: Lab) -> Records:
    return lab.build_records("alice", TINY_SERVED_NAME)


def _assert_404(resp, needle: str) -> None:
    assert resp.status_code == 404, (resp.status_code, resp.text)
    assert needle in resp.json()["error"], resp.text


def _assert_unknown_future(lab: Lab, user: str, path: str, body, needle: str) -> None:
    failed = lab.failure(user, path, body)
    assert failed["category"] == "user" and needle in failed["error"], failed


def test_an_upgraded_data_directory_keeps_its_records_for_their_user(
    lab: Lab, lab_server: TinkerServer
) -> None:
    """Records from before users belong to "default"; the future pending back then is lost (410)."""
    rest = tinker.RestClient(base_url=lab_server.url, api_key=KEYS["default"])
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == ["s-old:train:0"]
    paths = [c.tinker_path for c in rest.list_checkpoints("s-old:train:0").result().checkpoints]
    assert paths == ["tinker://s-old:train:0/weights/w1"]
    lost = lab.post("default", "retrieve_future", {"request_id": "req-old"})
    assert lost.status_code == 410 and "lost in a server restart" in lost.json()["error"], lost.text
    assert lab.post("alice", "retrieve_future", {"request_id": "req-old"}).status_code == 404
    assert lab.call("alice", "GET", "training_runs/s-old:train:0").status_code == 404


def test_another_users_ids_and_paths_answer_like_unknown_ones(lab: Lab, alice: Records) -> None:
    a = alice
    bob_session = lab.session("bob")
    # direct routes: 404, the very answer an id that does not exist gets
    for session_id in (a.session_id, "s-does-not-exist"):
        _assert_404(lab.post("bob", "session_heartbeat", {"session_id": session_id}), "unknown session")
        finish = lab.post("bob", f"sessions/{session_id}/finish", {"reason": {"type": "success"}})
        _assert_404(finish, "unknown session")
        body = {"session_id": session_id, "sampling_session_seq_id": 5, "base_model": TINY_SERVED_NAME}
        _assert_404(lab.post("bob", "create_sampling_session", body), "unknown session")
    for model_id in (a.model_id, "s-nope:train:0"):
        _assert_404(lab.post("bob", "get_info", {"model_id": model_id}), f"unknown model id '{model_id}'")
        _assert_404(lab.call("bob", "GET", f"training_runs/{model_id}"), "unknown training run")
        _assert_404(lab.call("bob", "GET", f"training_runs/{model_id}/checkpoints"), "unknown training run")
        delete = lab.call("bob", "DELETE", f"training_runs/{model_id}/checkpoints/weights/state")
        _assert_404(delete, "does not exist")
    for sampler_id in (a.sampler_id, "s-nope:sample:0"):
        _assert_404(lab.call("bob", "GET", f"samplers/{sampler_id}"), "unknown sampler")
    body = {"session_id": bob_session, "sampling_session_seq_id": 1, "model_path": a.sampler_path}
    _assert_404(lab.post("bob", "create_sampling_session", body), "does not exist")
    _assert_404(lab.post("bob", "retrieve_future", {"request_id": a.request_id}), "unknown request id")

    # operation routes: accepted, then the same "unknown ..." user error as for an unknown id
    model = a.model_id
    _assert_unknown_future(
        lab,
        "bob",
        "create_model",
        {"session_id": a.session_id, "model_seq_id": 7, "base_model": TINY_SERVED_NAME},
        "unknown session",
    )
    _assert_unknown_future(lab, "bob", "forward_backward", fb_body(model, 1), f"unknown model id '{model}'")
    _assert_unknown_future(lab, "bob", "forward", fb_body(model, 1), "unknown model id")
    opt = {"model_id": model, "seq_id": 9, "adam_params": {"learning_rate": 1.0}}
    _assert_unknown_future(lab, "bob", "optim_step", opt, "unknown model id")
    _assert_unknown_future(lab, "bob", "save_weights", {"model_id": model, "path": "x"}, "unknown model id")
    _assert_unknown_future(
        lab, "bob", "save_weights_for_sampler", {"model_id": model, "path": "x"}, "unknown model id"
    )
    _assert_unknown_future(
        lab, "bob", "load_weights", {"model_id": model, "path": a.state_path}, "unknown model id"
    )
    load_new = {"session_id": bob_session, "model_seq_id": 3, "path": a.state_path}
    _assert_unknown_future(lab, "bob", "load_weights", load_new, "does not exist")
    _assert_unknown_future(
        lab, "bob", "load_weights", {**load_new, "session_id": a.session_id}, "unknown session"
    )
    sample = {"num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}}
    sample["sampling_params"] = {"max_tokens": 2}
    _assert_unknown_future(
        lab, "bob", "asample", {**sample, "sampling_session_id": a.sampler_id}, "unknown sampling"
    )
    _assert_unknown_future(lab, "bob", "asample", {**sample, "model_path": a.sampler_path}, "does not exist")

    # ... and none of it changed anything of alice's
    assert lab.post("alice", "session_heartbeat", {"session_id": a.session_id}).status_code == 200
    paths = {
        c["tinker_path"]
        for c in lab.call("alice", "GET", f"training_runs/{model}/checkpoints").json()["checkpoints"]
    }
    assert paths == {a.state_path, a.sampler_path}
    assert lab.call("alice", "GET", f"samplers/{a.sampler_id}").status_code == 200
    assert lab.post("alice", "get_info", {"model_id": model}).status_code == 200
    assert lab.ok("alice", "forward", fb_body(model, 10))


def test_listings_show_only_the_callers_records(lab: Lab, alice: Records, lab_server: TinkerServer) -> None:
    bob = lab.build_records("bob", TINY_SERVED_NAME)
    runs = {
        u: {r["training_run_id"] for r in lab.call(u, "GET", "training_runs").json()["training_runs"]}
        for u in ("alice", "bob")
    }
    assert alice.model_id in runs["alice"] and bob.model_id not in runs["alice"]
    assert bob.model_id in runs["bob"] and alice.model_id not in runs["bob"]
    mine = {c["tinker_path"] for c in lab.call("bob", "GET", "checkpoints").json()["checkpoints"]}
    assert mine == {bob.state_path, bob.sampler_path}
    status = lab.http.get("/skylift/status", headers={"X-API-Key": KEYS["bob"]}).json()
    assert bob.model_id in status["loaded_models"] and alice.model_id not in status["loaded_models"]
    # bob deletes his own checkpoint; alice's of the same name stays
    assert (
        lab.call("bob", "DELETE", f"training_runs/{bob.model_id}/checkpoints/weights/state").status_code
        == 200
    )
    assert lab.call("alice", "GET", f"training_runs/{alice.model_id}/checkpoints").json()["checkpoints"]
    assert lab.http.get("/api/v1/training_runs").status_code == 401  # no key at all


def test_checkpoint_routes_are_the_owners_and_published_ones_readable(lab: Lab, alice: Records) -> None:
    """publish / unpublish / TTL, download URLs, weights_info, copy_weights and sessions: another
    user's answer like unknown ones; a published checkpoint becomes readable (never writable) by all."""
    run, sampler_ckpt = alice.model_id, f"training_runs/{alice.model_id}/checkpoints/sampler_weights/sampler"
    state_ckpt = f"training_runs/{run}/checkpoints/weights/state"
    for method, route, body in (
        ("POST", f"{state_ckpt}/publish", None),
        ("DELETE", f"{state_ckpt}/publish", None),
        ("PUT", f"{state_ckpt}/ttl", {"ttl_seconds": 60}),
        ("GET", f"{sampler_ckpt}/external_weights_urls", None),
    ):
        _assert_404(lab.call("bob", method, route, body), "does not exist")
    _assert_404(lab.post("bob", "weights_info", {"tinker_path": alice.state_path}), "does not exist")
    _assert_404(lab.post("bob", "copy_weights", {"source_path": alice.state_path}), "does not exist")
    _assert_404(lab.call("bob", "GET", f"sessions/{alice.session_id}"), "unknown session")
    assert alice.session_id not in str(lab.call("bob", "GET", "sessions").json())

    assert lab.call("alice", "POST", f"{state_ckpt}/publish").status_code == 204
    try:
        assert lab.post("bob", "weights_info", {"tinker_path": alice.state_path}).status_code == 200
        bob_session = lab.session("bob")
        loaded = lab.ok(
            "bob", "load_weights", {"session_id": bob_session, "model_seq_id": 0, "path": alice.state_path}
        )
        assert loaded["model_id"].startswith(bob_session)
        _assert_404(lab.call("bob", "PUT", f"{state_ckpt}/ttl", {"ttl_seconds": 60}), "does not exist")
        _assert_404(lab.call("bob", "DELETE", f"{state_ckpt}/publish"), "does not exist")
        _assert_404(lab.call("bob", "DELETE", state_ckpt), "does not exist")
    finally:
        assert lab.call("alice", "DELETE", f"{state_ckpt}/publish").status_code == 204
    _assert_404(lab.post("bob", "weights_info", {"tinker_path": alice.state_path}), "does not exist")


def test_users_training_at_once_keep_their_order_and_results(lab_server: TinkerServer) -> None:
    """Three users pipeline forward_backward/optim_step on their own models at once (the SDK sends
    them without waiting); each ends exactly where a lone sequential run ends."""
    data = sft_dataset()

    def train(user: str, wait_each: bool) -> np.ndarray:
        client = tinker.ServiceClient(base_url=lab_server.url, api_key=KEYS[user])
        tc = client.create_lora_training_client(base_model=TINY_SERVED_NAME, rank=4, seed=3).result()
        futures = []
        for _ in range(2):
            futures += [
                tc.forward_backward(data, "cross_entropy"),
                tc.optim_step(types.AdamParams(learning_rate=5e-3)),
            ]
            if wait_each:
                [f.result() for f in futures[-2:]]
        [f.result() for f in futures]
        out = logprobs_of(tc.forward([data[0]], "cross_entropy").result())
        client.close("success").result(timeout=60)
        return out

    reference = train("alice", wait_each=True)
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda u: train(u, wait_each=False), ["alice", "bob", "dave"]))
    for got in results:
        np.testing.assert_allclose(got, reference, atol=1e-5)


def test_queued_operations_of_a_finished_session_fail_at_once(lab: Lab) -> None:
    session_id = lab.session("bob")
    create = {
        "session_id": session_id,
        "model_seq_id": 0,
        "base_model": TINY_SERVED_NAME,
        "lora_config": {"rank": 4},
    }
    model_id = lab.ok("bob", "create_model", create)["model_id"]
    # seq_id 1 never comes: operations 2.. wait for it in the model's queue
    queued = [
        lab.post("bob", "forward_backward", fb_body(model_id, seq)).json()["request_id"]
        for seq in range(2, 6)
    ]
    assert (
        lab.post("bob", f"sessions/{session_id}/finish", {"reason": {"type": "success"}}).status_code == 200
    )
    start = time.monotonic()
    for request_id in queued:
        failed = lab.result("bob", request_id, timeout_s=10).json()
        assert failed["category"] == "user" and f"session {session_id} finished" in failed["error"], failed
    assert time.monotonic() - start < 5
    later = lab.failure("bob", "forward_backward", fb_body(model_id, 7))
    assert later["category"] == "user" and "not loaded" in later["error"]


def test_retrieved_results_are_pruned_after_the_retention(lab: Lab, lab_server: TinkerServer) -> None:
    session_id = lab.session("dave")
    create = {
        "session_id": session_id,
        "model_seq_id": 0,
        "base_model": TINY_SERVED_NAME,
        "lora_config": {"rank": 4},
    }
    request_id = lab.post("dave", "create_model", create).json()["request_id"]
    assert lab.result("dave", request_id).status_code == 200
    assert lab.result("dave", request_id).status_code == 200  # within the retention: still there
    db = sqlite3.connect(lab_server.data_dir / "tinker.db")
    query = "SELECT count(*) FROM tinker_futures WHERE request_id = ?"
    deadline = time.monotonic() + RETENTION_S + 10
    while db.execute(query, (request_id,)).fetchone()[0] and time.monotonic() < deadline:
        time.sleep(0.5)
    assert db.execute(query, (request_id,)).fetchone()[0] == 0
    assert lab.post("dave", "retrieve_future", {"request_id": request_id}).status_code == 404


def test_the_database_is_used_off_the_event_loop(lab: Lab, lab_server: TinkerServer) -> None:
    """While another process holds the database's write lock, a request that writes waits, and
    the server keeps answering everything else."""
    db = sqlite3.connect(lab_server.data_dir / "tinker.db", timeout=5, isolation_level=None)
    db.execute("BEGIN EXCLUSIVE")
    holder: dict[str, object] = {}
    writer = threading.Thread(target=lambda: holder.update(resp=lab.session("alice")))
    try:
        writer.start()
        time.sleep(0.5)  # create_session is now waiting for the lock
        start = time.monotonic()
        assert lab.call("alice", "GET", "get_server_capabilities").status_code == 200
        assert lab.http.get("/api/v1/healthz").status_code == 200
        elapsed = time.monotonic() - start
        assert writer.is_alive(), "create_session did not wait for the write lock"
    finally:
        time.sleep(max(0.0, 3.0 - 0.5))
        db.execute("COMMIT")
        writer.join(timeout=30)
    assert elapsed < 1.0, f"the server was blocked for {elapsed:.1f} s by a waiting database write"
    assert str(holder.get("resp", "")).startswith("s")


def test_internal_failures_are_server_errors_with_a_message(
    lab: Lab, lab_server: TinkerServer, alice: Records
) -> None:
    """A broken record (its config lost a field) is the server's fault: a 500 naming the error,
    never a 400 'malformed request'; an operation failing on it is a "server" failure."""
    db = sqlite3.connect(lab_server.data_dir / "tinker.db", isolation_level=None)
    broken = f"{alice.session_id}:train:99"
    db.execute(
        "INSERT INTO tinker_models (model_id, session_id, base_model, config, status, created_at, last_request_time)"
        " VALUES (?, ?, ?, ?, 'unloaded', '2026-01-01 00:00:00', '2026-01-01 00:00:00')",
        (broken, alice.session_id, TINY_SERVED_NAME, json.dumps({"lora_rank": 4})),
    )
    resp = lab.post("alice", "get_info", {"model_id": broken})
    assert resp.status_code == 500 and resp.json()["category"] == "server", resp.text
    assert "model_path" in resp.json()["error"]  # names what the record lacks
    db.execute(
        "INSERT INTO tinker_sampling_sessions (id, session_id, base_model, source, created_at)"
        " VALUES (?, ?, ?, 'no-such-source', '2026-01-01 00:00:00')",
        (f"{alice.session_id}:sample:99", alice.session_id, TINY_SERVED_NAME),
    )
    sample = {"num_samples": 1, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [5, 6]}]}}
    failed = lab.failure(
        "alice", "asample", {**sample, "sampling_session_id": f"{alice.session_id}:sample:99"}
    )
    assert failed["category"] == "server" and "no-such-source" in failed["error"], failed


def test_sighup_reloads_the_keys_and_a_revoked_key_is_refused_at_once(
    lab: Lab, lab_server: TinkerServer
) -> None:
    lab.keys["carol"] = "tml-carol-1"
    session = lab.session("dave")
    assert lab.post("carol", "create_session", {}).status_code == 401  # not yet a user
    keys_file: Path = lab_server.keys_file  # type: ignore[attr-defined]
    write_keys(keys_file, {**{u: k for u, k in KEYS.items() if u != "dave"}, "carol": "tml-carol-1"})
    assert lab_server.process is not None
    os.kill(lab_server.process.pid, signal.SIGHUP)
    deadline = time.monotonic() + 10
    while lab.post("dave", "session_heartbeat", {"session_id": session}).status_code != 401:
        assert time.monotonic() < deadline, "dave's revoked key still works"
        time.sleep(0.1)
    assert lab.call("dave", "GET", "training_runs").status_code == 401
    assert lab.post("carol", "create_session", {"tags": [], "user_metadata": {}}).status_code == 200
    assert lab.call("alice", "GET", "training_runs").status_code == 200
    # a broken file keeps the keys in force
    keys_file.write_text("alice\n")
    os.kill(lab_server.process.pid, signal.SIGHUP)
    time.sleep(1)
    assert lab.call("alice", "GET", "training_runs").status_code == 200
    assert lab_server.process.poll() is None
