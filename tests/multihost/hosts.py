"""Two simulated hosts on one machine: network namespaces joined by a veth pair.

Host A (10.231.0.1) and host B (10.231.0.2) are each a fresh network namespace held open by a
`sleep` process; `veth-a` in A and `veth-b` in B join them. Commands run in a host through
`nsenter -t <holder pid> -n`; this test process stays in its own namespace and reaches a host's
sockets from a thread that entered it (`Host.call`). Nothing leaves the namespaces the tests made.
Every process of a host is found by its network namespace, so teardown stops exactly those (by
PID) and a test can check that nothing was left behind.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000
SUBNET = "10.231.0"

#: Host-specific settings of the test environment that must not leak into another host.
HOST_ONLY_ENV = ("GLOO_SOCKET_IFNAME", "VLLM_HOST_IP", "RAY_ADDRESS")


def _netns_id(pid: int) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


@dataclass
class Host:
    name: str
    ip: str
    holder: subprocess.Popen
    ns_id: str = ""

    def cmd(self, args: Sequence[str]) -> list[str]:
        return ["nsenter", "-t", str(self.holder.pid), "-n", *args]

    def run(self, args: Sequence[str], timeout: float = 30.0, **kwargs: Any) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(args), timeout=timeout, capture_output=True, text=True, **kwargs)

    def popen(self, args: Sequence[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
        """Start `args` in this host, its output in `log`, in a session of its own."""
        with open(log, "ab") as out:
            return subprocess.Popen(
                self.cmd(args), stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in a thread that entered this host's network namespace."""
        box: dict[str, Any] = {}

        def target() -> None:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/proc/{self.holder.pid}/ns/net", os.O_RDONLY)
            try:
                if libc.setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), f"setns into {self.name}")
                box["value"] = fn(*args)
            except BaseException as exc:  # re-raised in the caller
                box["error"] = exc
            finally:
                os.close(fd)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        thread.join()
        if "error" in box:
            raise box["error"]
        return box["value"]

    def pids(self) -> list[int]:
        """Every process in this host's network namespace except the holder."""
        out = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != self.holder.pid and _netns_id(int(entry)) == self.ns_id:
                out.append(int(entry))
        return sorted(out)

    def describe(self, pids: Sequence[int]) -> str:
        lines = []
        for pid in pids:
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:160]
            except OSError:
                cmdline = "(gone)"
            lines.append(f"{pid}: {cmdline}")
        return "\n".join(lines)

    def kill_all(self, grace_s: float = 10.0) -> list[int]:
        """SIGTERM every process of this host, SIGKILL what is left after `grace_s`; the PIDs found."""
        found = self.pids()
        for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
            for pid in self.pids():
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + wait
            while self.pids() and time.monotonic() < deadline:
                time.sleep(0.2)
            if not self.pids():
                break
        return found


@dataclass
class TwoHosts:
    a: Host
    b: Host
    env: dict[str, str] = field(default_factory=dict)

    def link(self, up: bool) -> None:
        state = "up" if up else "down"
        result = self.a.run(["ip", "link", "set", "veth-a", state])
        if result.returncode != 0:
            raise RuntimeError(f"ip link set veth-a {state}: {result.stderr}")
        if up:  # the route to B comes back with the interface
            self.b.run(["ip", "link", "set", "veth-b", "up"])

    def env_for(self, host: Host, **extra: str) -> dict[str, str]:
        """The tests' environment for processes of `host` (vLLM advertises the host's own IP)."""
        return {**self.env, "VLLM_HOST_IP": host.ip, **extra}

    def close(self) -> None:
        for host in (self.a, self.b):
            host.kill_all(grace_s=5.0)
            host.holder.kill()
            host.holder.wait(timeout=10)


def missing_tools() -> str | None:
    """Why two hosts cannot be simulated here (None when they can)."""
    if os.geteuid() != 0:
        return "simulated hosts need root (network namespaces and a veth pair); CI runs as root"
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            return f"simulated hosts need `{tool}` (util-linux / iproute2)"
    return None


def _holder() -> subprocess.Popen:
    return subprocess.Popen(["unshare", "-n", "sleep", "86400"], start_new_session=True)


def make_two_hosts() -> TwoHosts:
    """Create hosts A and B; raises `PermissionError` with the failing step when not permitted."""
    a = Host("host A", f"{SUBNET}.1", _holder())
    b = Host("host B", f"{SUBNET}.2", _holder())
    hosts = TwoHosts(a, b)
    try:
        deadline = time.monotonic() + 10
        for host in (a, b):
            while _netns_id(host.holder.pid) in (None, _netns_id(os.getpid())):
                if host.holder.poll() is not None or time.monotonic() > deadline:
                    raise PermissionError(f"`unshare -n` failed (exit {host.holder.returncode})")
                time.sleep(0.02)
            host.ns_id = _netns_id(host.holder.pid) or ""
        steps = [
            (a, ["ip", "link", "set", "lo", "up"]),
            (b, ["ip", "link", "set", "lo", "up"]),
            (a, ["ip", "link", "add", "veth-a", "type", "veth", "peer", "name", "veth-b"]),
            (a, ["ip", "link", "set", "veth-b", "netns", str(b.holder.pid)]),
            (a, ["ip", "addr", "add", f"{a.ip}/24", "dev", "veth-a"]),
            (a, ["ip", "link", "set", "veth-a", "up"]),
            (b, ["ip", "addr", "add", f"{b.ip}/24", "dev", "veth-b"]),
            (b, ["ip", "link", "set", "veth-b", "up"]),
        ]
        for host, args in steps:
            result = host.run(args)
            if result.returncode != 0:
                raise PermissionError(f"{host.name}: `{' '.join(args)}` failed: {result.stderr.strip()}")
    except BaseException:
        hosts.close()
        raise
    env = {k: v for k, v in os.environ.items() if k not in HOST_ONLY_ENV}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    hosts.env = env
    return hosts


def wait_until(predicate: Callable[[], bool], timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll_s)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")
