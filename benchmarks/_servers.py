"""What the benchmarks share: their environment, and starting/stopping a server child process.

Benchmarks run as `python benchmarks/NAME.py`, so this module is importable as `_servers`.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path

from skylift.utils.processes import stop_process_group

BENCHMARK_ENV = {
    "HF_HUB_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "TOKENIZERS_PARALLELISM": "false",
}


def set_benchmark_env(**extra: str) -> None:
    """Offline, loopback-only engine settings (and `extra`), where the user has not set them."""
    for key, value in {**BENCHMARK_ENV, **extra}.items():
        os.environ.setdefault(key, value)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    cmd: Sequence[str],
    port: int,
    log_path: Path,
    timeout_s: float,
    health_path: str = "/health",
    env: dict[str, str] | None = None,
) -> tuple[subprocess.Popen, str]:
    """Start `cmd` (a server listening on 127.0.0.1:`port`) in its own process group, logging to
    `log_path`; return it and its URL once `health_path` answers, or exit with the log's tail."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            list(cmd), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(
                f"server exited ({proc.returncode}); log {log_path}:\n{log_path.read_text()[-4000:]}"
            )
        try:
            with urllib.request.urlopen(url + health_path, timeout=5) as resp:
                if resp.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"server not healthy after {timeout_s} s; log {log_path}")


def stop_server(proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM our child, then SIGKILL its process group (the engine's processes) if anything is left."""
    stop_process_group(proc, grace_s=timeout_s)
