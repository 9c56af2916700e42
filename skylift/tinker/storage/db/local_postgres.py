"""A throw-away PostgreSQL cluster on loopback (tests and benchmarks run the Tinker service on it).

It uses the server binaries of Debian's `postgresql` package (`/usr/lib/postgresql/<ver>/bin`,
or `initdb` / `pg_ctl` on PATH). PostgreSQL refuses to run as root, so as root the cluster runs
as the user `nobody` (through `runuser`) in a directory that user owns.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

START_TIMEOUT_S = 60.0


def find_bin_dir() -> Path | None:
    """Directory holding `initdb` and `pg_ctl` (the newest installed version), or None."""
    candidates = sorted(glob.glob("/usr/lib/postgresql/*/bin"), key=lambda p: int(Path(p).parent.name))
    for directory in reversed(candidates):
        if (Path(directory) / "initdb").exists() and (Path(directory) / "pg_ctl").exists():
            return Path(directory)
    initdb = shutil.which("initdb")
    if initdb and shutil.which("pg_ctl"):
        return Path(os.path.realpath(initdb)).parent
    return None


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalPostgres:
    """`start()` a fresh cluster in a temporary directory, `url` to connect, `stop()` removes it."""

    def __init__(self, bin_dir: Path | None = None, database: str = "skylift") -> None:
        found = bin_dir or find_bin_dir()
        if found is None:
            raise FileNotFoundError(
                "PostgreSQL server binaries not found (install Debian's `postgresql` package: "
                "apt-get install -y postgresql)"
            )
        self.bin_dir = found
        self.database = database
        self.port = 0
        self.root: Path | None = None
        self._as: list[str] = []

    @property
    def url(self) -> str:
        return self.url_of(self.database)

    def url_of(self, database: str) -> str:
        return f"postgresql+psycopg://skylift@127.0.0.1:{self.port}/{database}"

    def create_database(self, name: str) -> str:
        """Create another (empty) database in the cluster; its URL."""
        self._run(f"{self.bin_dir}/createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "skylift", name)
        return self.url_of(name)

    def _run(self, *args: str, timeout: float = START_TIMEOUT_S) -> str:
        cmd = [*self._as, *args]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
        return done.stdout

    def start(self) -> LocalPostgres:
        self.root = Path(tempfile.mkdtemp(prefix="skylift-pg-"))
        data, sockets = self.root / "data", self.root / "sockets"
        sockets.mkdir()
        if os.geteuid() == 0:
            self._as = ["runuser", "-u", "nobody", "--"]
            shutil.chown(self.root, "nobody")
            shutil.chown(sockets, "nobody")
        self.root.chmod(0o700)
        bin_dir = str(self.bin_dir)
        self._run(
            f"{bin_dir}/initdb", "-D", str(data), "-U", "skylift", "--auth=trust", "-E", "UTF8", "--no-sync"
        )
        self.port = _free_port()
        options = (
            f"-c listen_addresses=127.0.0.1 -p {self.port} -k {sockets} -c fsync=off -c max_connections=200"
        )
        self._run(
            f"{bin_dir}/pg_ctl", "-D", str(data), "-l", str(self.root / "server.log"), "-o", options, "-w",
            "-t", str(int(START_TIMEOUT_S)), "start",
        )  # fmt: skip
        self._wait_connectable()
        self._run(
            f"{bin_dir}/createdb", "-h", "127.0.0.1", "-p", str(self.port), "-U", "skylift", self.database
        )
        return self

    def _wait_connectable(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=1):
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(
            f"PostgreSQL on 127.0.0.1:{self.port} did not accept connections in {START_TIMEOUT_S}s"
        )

    def log_tail(self, lines: int = 40) -> str:
        if self.root is None or not (self.root / "server.log").exists():
            return ""
        return "\n".join((self.root / "server.log").read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.root is None:
            return
        if (self.root / "data" / "postmaster.pid").exists():
            try:
                self._run(
                    f"{self.bin_dir}/pg_ctl", "-D", str(self.root / "data"), "-m", "immediate", "-w", "stop"
                )
            except (RuntimeError, subprocess.TimeoutExpired):
                pass
        shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def __enter__(self) -> LocalPostgres:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
