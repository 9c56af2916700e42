"""Launching the servers under test as subprocesses: `skylift serve` and `skylift tinker serve`.

Shared by the session fixtures in tests/conftest.py (inference servers), tests/tinker/conftest.py
and tests/reliability/conftest.py (Tinker servers). Pytest puts tests/ on sys.path (tests/conftest.py
sits in a directory without __init__.py), so test modules import this as `server_helpers`.

Servers bind 127.0.0.1 (by default, or explicitly). Run them inside a loopback-only network
namespace (`bash scripts/loopback.sh .venv/bin/pytest ...`); outside one (any interface besides
`lo`), `require_loopback_namespace` skips unless SKYLIFT_TESTS_ALLOW_NETWORK=1.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from skylift.utils.processes import stop_process_group

STARTUP_TIMEOUT_S = float(os.environ.get("SKYLIFT_TEST_SERVER_STARTUP_S", "420"))
TINKER_STARTUP_TIMEOUT_S = 120.0
TEST_API_KEY = "skylift-test-key"
TINY_SERVED_NAME = "tiny-qwen2"
TINY_MAX_MODEL_LEN = 512


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def only_loopback_network() -> bool:
    """True inside a network namespace whose only interface is `lo`."""
    return {name for _, name in socket.if_nameindex()} <= {"lo"}


def require_loopback_namespace() -> None:
    if os.environ.get("SKYLIFT_TESTS_ALLOW_NETWORK") == "1" or only_loopback_network():
        return
    pytest.skip(
        "test servers run only in a loopback-only network namespace: "
        "bash scripts/loopback.sh .venv/bin/pytest ... (or set SKYLIFT_TESTS_ALLOW_NETWORK=1)"
    )


def _log_tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def kill_group(process: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM `process`, then SIGKILL its process group (which we created) if anything lingers."""
    stop_process_group(process, grace_s)


# ----------------------------------------------------------------------- inference server


@dataclass
class ServerHandle:
    """A running `skylift serve` subprocess."""

    url: str
    process: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    def log_tail(self, lines: int = 60) -> str:
        return _log_tail(self.log_path, lines)


def start_server(
    model: str | Path,
    log_path: Path,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
    host: str | None = "127.0.0.1",
) -> ServerHandle:
    """Launch `python -m skylift.inference.server` on a free loopback port (does not wait).

    `host=None` leaves --host out: the server's default (127.0.0.1) applies.
    """
    port = free_port()
    cmd = [sys.executable, "-m", "skylift.inference.server", "--model", str(model), "--port", str(port)]
    if host is not None:
        cmd += ["--host", host]
    cmd += list(extra_args)
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_HOST_IP", "127.0.0.1")
    env.setdefault("GLOO_SOCKET_IFNAME", "lo")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "wb")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    log.close()
    return ServerHandle(url=f"http://127.0.0.1:{port}", process=process, log_path=log_path, api_key=api_key)


def wait_healthy(handle: ServerHandle, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
    """Poll /health until 200; on exit or timeout, fail with the log's tail."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        code = handle.process.poll()
        if code is not None:
            pytest.fail(
                f"server {handle.url} exited with code {code} during start-up; log "
                f"{handle.log_path}:\n{handle.log_tail()}"
            )
        try:
            with urllib.request.urlopen(handle.url + "/health", timeout=5) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    stop_server(handle)
    pytest.fail(
        f"server {handle.url} not healthy after {timeout_s:.0f} s; log {handle.log_path}:\n{handle.log_tail()}"
    )


def stop_server(handle: ServerHandle, grace_s: float = 30.0) -> None:
    kill_group(handle.process, grace_s)


def tiny_server_args() -> list[str]:
    return [
        "--served-model-name",
        TINY_SERVED_NAME,
        "--max-model-len",
        str(TINY_MAX_MODEL_LEN),
        "--dtype",
        "float32",
        "--seed",
        "0",
        "--enable-prefix-caching",
        "--max-num-seqs",
        "64",
        "--enforce-eager",  # no torch.compile warm-up: start-up in seconds, not minutes
        # vLLM's /inference/v1/generate (a verifiers env server samples through it)
        "--enable-scale-out",
    ]


# -------------------------------------------------------------------------- Tinker server


@dataclass
class TinkerServer:
    """A `skylift tinker serve` subprocess on the tiny model that can be stopped and started again.

    `host=None` leaves --host out (the default, 127.0.0.1, applies); clients always connect to
    127.0.0.1.
    """

    data_dir: Path
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    host: str | None = "127.0.0.1"
    base_model: str = TINY_SERVED_NAME
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, port: int | None = None) -> None:
        """Start the server (on `port`, e.g. the one it had before a restart; default: a free one)."""
        self.port = port or free_port()
        cmd = [
            sys.executable, "-m", "skylift.tinker.commands", "serve",
            "--base-model", self.base_model, "--port", str(self.port),
            "--data-dir", str(self.data_dir), "--log-level", "warning",
        ]  # fmt: skip
        if self.host is not None:
            cmd += ["--host", self.host]
        cmd += self.extra_args
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child)
        env = {**os.environ, **self.env}
        self.process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        deadline = time.monotonic() + TINKER_STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tinker server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tinker server not healthy after {TINKER_STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the server (it shuts its engine down), then SIGKILL whatever is left of its group."""
        if self.process is None:
            return
        kill_group(self.process, grace_s=90)
        self.process = None

    def __enter__(self) -> TinkerServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def status(self, headers: dict[str, str] | None = None) -> dict[str, Any]:
        req = urllib.request.Request(f"{self.url}/skylift/status", headers=headers or {})
        with urllib.request.urlopen(req, timeout=10) as resp:
            return json.loads(resp.read())

    def log_tail(self, lines: int = 60) -> str:
        return _log_tail(self.log_path, lines)
