"""Tinker-service servers for the tests, driven with the real `tinker` SDK (api key `tml-dummy`).

`tinker_server`: ONE `skylift tinker serve` subprocess on the tiny model for the whole session; its
inference engine starts lazily on the first sample and is shared by every test.
`no_engine_server`: a second server whose engine start-up always fails
(SKYLIFT_TINKER_FAIL_ENGINE_START=1), with a short session timeout; it never runs vLLM, so it is
cheap, and tests restart it on the same database and data directory.

Run inside a loopback-only namespace: unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/tinker'
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

API_KEY = "tml-dummy"
BASE_MODEL = "tiny-qwen2"
STARTUP_TIMEOUT_S = 120.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _require_loopback() -> None:
    if os.environ.get("SKYLIFT_TESTS_ALLOW_NETWORK") == "1":
        return
    if {name for _, name in socket.if_nameindex()} <= {"lo"}:
        return
    pytest.skip(
        "tinker servers run only in a loopback-only namespace: unshare -n sh -c 'ip link set lo up; ...'"
    )


@dataclass
class TinkerServer:
    """A `skylift tinker serve` subprocess that can be stopped and started again on its data."""

    data_dir: Path
    log_path: Path
    extra_args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    port: int = 0
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        self.port = _free_port()
        cmd = [
            sys.executable, "-m", "skylift.tinker.commands", "serve",
            "--base-model", BASE_MODEL, "--host", "127.0.0.1", "--port", str(self.port),
            "--data-dir", str(self.data_dir), "--log-level", "warning", *self.extra_args,
        ]  # fmt: skip
        log = open(self.log_path, "ab")  # noqa: SIM115 (kept open for the child)
        env = {**os.environ, **self.env}
        self.process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"tinker server exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.url}/api/v1/healthz", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"tinker server not healthy after {STARTUP_TIMEOUT_S}s:\n{self.log_tail()}")

    def stop(self) -> None:
        """SIGTERM the server (it shuts its engine down), then SIGKILL whatever is left of its group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=30)
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process = None

    def status(self) -> dict:
        with urllib.request.urlopen(f"{self.url}/skylift/status", timeout=10) as resp:
            return json.loads(resp.read())

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _server(tmp: Path, tiny_model_dir: Path, name: str, **kwargs) -> Iterator[TinkerServer]:
    _require_loopback()
    assert tiny_model_dir.is_dir()
    server = TinkerServer(data_dir=tmp / name, log_path=tmp / f"{name}.log", **kwargs)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def tinker_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[TinkerServer]:
    yield from _server(tmp_path_factory.mktemp("tinker"), tiny_model_dir, "main")


@pytest.fixture(scope="session")
def no_engine_server(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[TinkerServer]:
    yield from _server(
        tmp_path_factory.mktemp("tinker-noengine"),
        tiny_model_dir,
        "noengine",
        extra_args=["--session-timeout", "15", "--cleanup-interval", "1"],
        env={"SKYLIFT_TINKER_FAIL_ENGINE_START": "1"},
    )


@pytest.fixture
def service_client(tinker_server: TinkerServer) -> Iterator:
    import tinker

    client = tinker.ServiceClient(base_url=tinker_server.url, api_key=API_KEY)
    yield client
    client.close("success").result(timeout=60)
