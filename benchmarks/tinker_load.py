"""retrieve_future under load: a Tinker server on SQLite vs the same server on PostgreSQL.

Two `skylift tinker serve --base-model tiny-qwen2 --api-keys-file ...` child processes, one on its
default SQLite file, one on a throw-away PostgreSQL cluster on loopback (Debian's `postgresql`
package, `skylift.tinker.storage.db.local_postgres`). On each, `--users` users create a session and one
LoRA model each (so every user holds finished futures), then `--clients` concurrent HTTP clients
(round-robin over the users) call `retrieve_future` on their own finished futures for
`--seconds` seconds: every call authenticates, checks the owner and reads the result from the
database. No inference engine ever starts.

Measured per backend: requests per second and the p50 / p99 latency. Rounds alternate the order
of the two backends; the best round of each is compared (other load on a shared machine only
slows a round down).

Last line: JSON `{"ratio": postgres_rps / sqlite_rps, "p99_ratio": ..., "sqlite": {...}, "postgres": {...}}`.

Run (servers bind 127.0.0.1 only):
    python benchmarks/tinker_load.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from _servers import free_port, set_benchmark_env, start_server, stop_server

from skylift.tinker.storage.db.local_postgres import LocalPostgres

BASE_MODEL = "tiny-qwen2"


def _keys(users: int) -> dict[str, str]:
    return {f"user{i}": f"tml-bench-{i}" for i in range(users)}


def _prepare(url: str, keys: dict[str, str]) -> dict[str, list[str]]:
    """Per user: the request ids of its finished futures (create_model and a forward)."""
    futures: dict[str, list[str]] = {}
    with httpx.Client(base_url=url + "/api/v1", timeout=120) as http:
        for user, key in keys.items():
            h = {"X-API-Key": key}
            sid = http.post("/create_session", json={"tags": [], "user_metadata": {}}, headers=h).json()[
                "session_id"
            ]
            body = {
                "session_id": sid,
                "model_seq_id": 0,
                "base_model": BASE_MODEL,
                "lora_config": {"rank": 4},
            }
            ids = [http.post("/create_model", json=body, headers=h).json()["request_id"]]
            for rid in ids:
                deadline = time.monotonic() + 300
                while http.post("/retrieve_future", json={"request_id": rid}, headers=h).status_code == 408:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"future {rid} on {url} did not finish in 300 s")
            futures[user] = ids
    return futures


async def _load(
    url: str, keys: dict[str, str], futures: dict[str, list[str]], clients: int, seconds: float
) -> dict[str, Any]:
    users = list(keys)
    latencies: list[float] = []
    errors = 0

    async def client(i: int) -> None:
        nonlocal errors
        user = users[i % len(users)]
        headers = {"X-API-Key": keys[user]}
        ids = futures[user]
        async with httpx.AsyncClient(base_url=url + "/api/v1", timeout=30) as http:
            n = 0
            while time.monotonic() < stop:
                start = time.perf_counter()
                resp = await http.post(
                    "/retrieve_future", json={"request_id": ids[n % len(ids)]}, headers=headers
                )
                latencies.append(time.perf_counter() - start)
                errors += resp.status_code != 200
                n += 1

    stop = time.monotonic() + seconds
    began = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(clients)))
    elapsed = time.perf_counter() - began
    latencies.sort()
    return {
        "requests": len(latencies),
        "errors": errors,
        "rps": round(len(latencies) / elapsed, 1),
        "p50_ms": round(1000 * statistics.median(latencies), 2),
        "p99_ms": round(1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))], 2),
    }


def _run(
    backend: str, db_url: str | None, keys: dict[str, str], args: argparse.Namespace, work: Path
) -> dict[str, Any]:
    data = Path(tempfile.mkdtemp(prefix=f"tinker-load-{backend}-", dir=work))
    keys_file = data / "keys.txt"
    keys_file.write_text("".join(f"{u} {k}\n" for u, k in keys.items()))
    port = free_port()
    cmd = [
        sys.executable, "-m", "skylift.tinker.commands", "serve", "--base-model", BASE_MODEL,
        "--port", str(port), "--data-dir", str(data / "data"), "--api-keys-file", str(keys_file),
        "--log-level", "warning",
    ]  # fmt: skip
    if db_url:
        cmd += ["--database-url", db_url]
    env = {**os.environ, "SKYLIFT_TINKER_FAIL_ENGINE_START": "1"}
    proc, url = start_server(
        cmd, port, data / "server.log", timeout_s=300, health_path="/api/v1/healthz", env=env
    )
    try:
        futures = _prepare(url, keys)
        asyncio.run(_load(url, keys, futures, args.clients, min(2.0, args.seconds)))  # warm-up
        return asyncio.run(_load(url, keys, futures, args.clients, args.seconds))
    finally:
        stop_server(proc)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--users", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    set_benchmark_env(SKYLIFT_TINKER_FAIL_ENGINE_START="1")
    keys = _keys(args.users)
    work = Path(tempfile.mkdtemp(prefix="tinker-load-"))
    best: dict[str, dict[str, Any]] = {}
    with LocalPostgres() as pg:
        for r in range(args.rounds):
            order = ["sqlite", "postgres"] if r % 2 == 0 else ["postgres", "sqlite"]
            for backend in order:
                db_url = pg.create_database(f"load{r}") if backend == "postgres" else None
                got = _run(backend, db_url, keys, args, work)
                print(f"round {r + 1} {backend:8s}: {got['rps']:8.1f} req/s  p50 {got['p50_ms']:.2f} ms  "
                      f"p99 {got['p99_ms']:.2f} ms  ({got['requests']} requests, {got['errors']} errors)", flush=True)  # fmt: skip
                if backend not in best or got["rps"] > best[backend]["rps"]:
                    best[backend] = got
    load = os.getloadavg()
    summary = {
        "ratio": round(best["postgres"]["rps"] / best["sqlite"]["rps"], 4),
        "p99_ratio": round(best["postgres"]["p99_ms"] / best["sqlite"]["p99_ms"], 4),
        "sqlite": best["sqlite"],
        "postgres": best["postgres"],
        "clients": args.clients,
        "users": args.users,
        "seconds": args.seconds,
        "cpus": os.cpu_count(),
        "loadavg_1m_at_end": round(load[0], 2),
    }
    print(
        f"retrieve_future, {args.clients} clients: SQLite {best['sqlite']['rps']} req/s (p99 "
        f"{best['sqlite']['p99_ms']} ms) vs PostgreSQL {best['postgres']['rps']} req/s (p99 "
        f"{best['postgres']['p99_ms']} ms): ratio {summary['ratio']:.3f}; load average {load[0]:.1f} "
        f"on {os.cpu_count()} CPUs"
    )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
