"""Session-scoped skylift inference servers on the tiny model, shared by integration tests.

`tiny_server_url` is ONE `python -m skylift.inference.server` subprocess (fp32, max_model_len 512)
started on first use and stopped at the end of the session. `tiny_server_with_key` is a second one
protected by an API key (used for the 401 cases and the two-servers-behind-one-client tests).

Servers bind 127.0.0.1. Run these tests inside a loopback-only network namespace:
    unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/integration'
Outside one (any interface besides `lo`), the server fixtures skip unless
SKYLIFT_TESTS_ALLOW_NETWORK=1.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Coroutine, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import pytest

STARTUP_TIMEOUT_S = float(os.environ.get("SKYLIFT_TEST_SERVER_STARTUP_S", "420"))
TEST_API_KEY = "skylift-test-key"
TINY_SERVED_NAME = "tiny-qwen2"
TINY_MAX_MODEL_LEN = 512

T = TypeVar("T")


@dataclass
class ServerHandle:
    """A running server subprocess."""

    url: str
    process: subprocess.Popen
    log_path: Path
    api_key: str | None = None

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


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
        "integration servers run only in a loopback-only network namespace: "
        "unshare -n sh -c 'ip link set lo up; .venv/bin/pytest tests/integration' "
        "(or set SKYLIFT_TESTS_ALLOW_NETWORK=1)"
    )


def start_server(
    model: str | Path,
    log_path: Path,
    extra_args: Sequence[str] = (),
    api_key: str | None = None,
) -> ServerHandle:
    """Launch `python -m skylift.inference.server` on a free loopback port (does not wait)."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "skylift.inference.server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *extra_args,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    env = dict(os.environ)
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
    """SIGTERM the server, then SIGKILL its process group (which we created) if it lingers."""
    proc = handle.process
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the engine core / worker children, if left over
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        pass


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
    ]


def _serve(model_dir: Path, log_path: Path, api_key: str | None) -> Iterator[ServerHandle]:
    require_loopback_namespace()
    handle = start_server(model_dir, log_path, tiny_server_args(), api_key=api_key)
    try:
        wait_healthy(handle)
        yield handle
    finally:
        stop_server(handle)


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    """One skylift server on the tiny model for the whole session (no API key)."""
    log = tmp_path_factory.mktemp("tiny_server") / "server.log"
    yield from _serve(tiny_model_dir, log, api_key=None)


@pytest.fixture(scope="session")
def tiny_server_url(tiny_server: ServerHandle) -> str:
    """Base URL (http://127.0.0.1:PORT) of the session's tiny-model server."""
    return tiny_server.url


@pytest.fixture(scope="session")
def tiny_server_with_key(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerHandle]:
    """A second tiny-model server that requires `TEST_API_KEY`."""
    log = tmp_path_factory.mktemp("tiny_server_key") / "server.log"
    yield from _serve(tiny_model_dir, log, api_key=TEST_API_KEY)


# --------------------------------------------------------------------------- in-process engine


class EngineLoop:
    """One event loop for the session: AsyncLLM's output handler is bound to the loop it starts in."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float = 300.0) -> T:
        return self.loop.run_until_complete(asyncio.wait_for(coro, timeout_s))

    def close(self) -> None:
        self.loop.run_until_complete(self.loop.shutdown_default_executor())
        self.loop.close()


@pytest.fixture()
def loopback_only() -> None:
    """Skip unless running in a loopback-only network namespace (see the module docstring)."""
    require_loopback_namespace()


@pytest.fixture(scope="session")
def loop() -> Iterator[EngineLoop]:
    runner = EngineLoop()
    yield runner
    runner.close()


@pytest.fixture(scope="session")
def engine(tiny_model_dir: Path, loop: EngineLoop) -> Iterator[Any]:
    """One in-process `LocalVLLMEngine` on the tiny model (fp32) for the whole session."""
    from skylift.inference.local import LocalVLLMEngine

    require_loopback_namespace()
    eng = loop.run(
        LocalVLLMEngine.create(
            str(tiny_model_dir),
            max_model_len=512,
            seed=0,
            dtype="float32",
            max_num_seqs=16,
            enable_prefix_caching=True,
            enforce_eager=True,  # no torch.compile warm-up: start-up in seconds, not minutes
        ),
        timeout_s=600.0,
    )
    yield eng
    loop.run(eng.close())
