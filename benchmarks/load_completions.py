"""Concurrent load on one `skylift serve`: 1,000 completion requests at once, tiny model.

The server is a child process (`python -m skylift.inference.server`, tiny-qwen2, fp32, eager, default
bind 127.0.0.1). After a warm-up, `--unloaded` single requests go one at a time (the baseline), then
`--requests` requests are sent together from one client (`--client`: aiohttp, the default, or
httpx.AsyncClient) whose connection limits allow `--concurrency` connections at once (all 1,000 open
together by default). Every request asks for
exactly `--max-tokens` tokens (`ignore_eos`). A request is an error unless it answers 200 with that
many tokens; the run fails (exit 1) on any error.

ratio = p50 latency under load / p50 latency of a single unloaded request: how many times longer
the typical request waits when 1,000 arrive together (lower is better; the engine runs at most
`--max-num-seqs` sequences at a time, so queueing alone makes it grow with the burst size).

Latency is measured client-side, from sending a request to reading its whole response. The client
shares the machine's cores with the server: the JSON also says how many CPU seconds the client, the
API server process and the engine's processes used during the burst, and the engine's own mean
queue time and end-to-end time per request (from vLLM's /metrics), which split the latency into
waiting for a batch slot, engine work, and HTTP/API overhead.

Last stdout line: one JSON object with "ratio" and the raw figures.

Run (inside a loopback-only namespace):
    bash scripts/loopback.sh .venv/bin/python benchmarks/load_completions.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import httpx
import psutil
from _servers import free_port, stop_server
from _servers import start_server as start_server_process

SERVED_NAME = "tiny-qwen2"


def start_server(args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable, "-m", "skylift.inference.server",
        "--model", args.model, "--served-model-name", SERVED_NAME, "--port", str(port),
        "--dtype", "float32", "--max-model-len", str(args.max_model_len), "--seed", "0",
        "--max-num-seqs", str(args.max_num_seqs), "--enforce-eager", "--disable-uvicorn-access-log",
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_HOST_IP": "127.0.0.1", "GLOO_SOCKET_IFNAME": "lo"}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return start_server_process(cmd, port, log_path, args.startup_timeout_s, env=env)


@dataclass
class Outcome:
    latency_s: float
    error: str | None  # None: 200 with max_tokens tokens
    tokens: int = 0


class Client:
    """One HTTP client library behind `post_json`, its connection limit set to `concurrency`."""

    def __init__(self, kind: str, concurrency: int, timeout_s: float) -> None:
        self.kind = kind
        self.concurrency = concurrency
        self.timeout_s = timeout_s
        self._httpx: httpx.AsyncClient | None = None
        self._aiohttp: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        if self.kind == "httpx":
            limits = httpx.Limits(
                max_connections=self.concurrency, max_keepalive_connections=self.concurrency
            )
            self._httpx = httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(self.timeout_s))
        else:
            connector = aiohttp.TCPConnector(limit=self.concurrency, limit_per_host=self.concurrency)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            self._aiohttp = aiohttp.ClientSession(connector=connector, timeout=timeout)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._httpx is not None:
            await self._httpx.aclose()
        if self._aiohttp is not None:
            await self._aiohttp.close()

    async def post_json(self, url: str, body: dict) -> tuple[int, str]:
        """(status, response text)."""
        if self._httpx is not None:
            resp = await self._httpx.post(url, json=body)
            return resp.status_code, resp.text
        assert self._aiohttp is not None
        async with self._aiohttp.post(url, json=body) as resp:
            return resp.status, await resp.text()


async def one_request(client: Client, url: str, i: int, max_tokens: int) -> Outcome:
    body = {
        "model": SERVED_NAME,
        "prompt": f"Request number {i} says:",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": i,
    }
    start = time.perf_counter()
    try:
        status, text = await client.post_json(url + "/v1/completions", body)
        payload = json.loads(text) if status == 200 else None
    except (httpx.HTTPError, aiohttp.ClientError, TimeoutError, ValueError) as exc:
        return Outcome(time.perf_counter() - start, f"{type(exc).__name__}: {exc}")
    latency = time.perf_counter() - start
    if payload is None:
        return Outcome(latency, f"HTTP {status}: {text[:200]}")
    tokens = int(payload["usage"]["completion_tokens"])
    if tokens != max_tokens:
        return Outcome(latency, f"{tokens} tokens instead of {max_tokens}")
    return Outcome(latency, None, tokens)


def cpu_seconds(procs: dict[str, list[psutil.Process]]) -> dict[str, float]:
    """User + system CPU seconds used so far by each group of processes."""
    out = {}
    for name, group in procs.items():
        total = 0.0
        for proc in group:
            try:
                times = proc.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
        out[name] = total
    return out


def engine_histograms(url: str) -> dict[str, float]:
    """Sums and counts of vLLM's per-request queue-time and end-to-end histograms (/metrics)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for name in ("vllm:request_queue_time_seconds", "vllm:e2e_request_latency_seconds"):
        for suffix in ("_sum", "_count"):
            values = re.findall(rf"^{re.escape(name + suffix)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
            out[name + suffix] = sum(float(v) for v in values)
    return out


def mean_delta(before: dict[str, float], after: dict[str, float], name: str) -> float:
    count = after[name + "_count"] - before[name + "_count"]
    return (after[name + "_sum"] - before[name + "_sum"]) / count if count else float("nan")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100])."""
    ordered = sorted(values)
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


async def measure(url: str, args: argparse.Namespace, server_pid: int) -> dict:
    async with Client(args.client, args.concurrency, args.request_timeout_s) as client:
        for i in range(args.warmup):
            await one_request(client, url, -1 - i, args.max_tokens)
        unloaded = [await one_request(client, url, i, args.max_tokens) for i in range(args.unloaded)]
        server = psutil.Process(server_pid)
        procs = {
            "client": [psutil.Process()],
            "api_server": [server],
            "engine": server.children(recursive=True),
        }
        cpu_before = cpu_seconds(procs)
        hist_before = engine_histograms(url)
        # The burst: every request created at once; the client's limits let them all connect together.
        start = time.perf_counter()
        loaded = await asyncio.gather(
            *(one_request(client, url, i, args.max_tokens) for i in range(args.requests))
        )
        wall_s = time.perf_counter() - start
        cpu_after = cpu_seconds(procs)
        hist_after = engine_histograms(url)

    errors = [o.error for o in unloaded + loaded if o.error is not None]
    ok = [o for o in loaded if o.error is None]
    lat = [o.latency_s for o in loaded]
    single_p50 = statistics.median(o.latency_s for o in unloaded)
    load_p50 = percentile(lat, 50)
    return {
        "ratio": round(load_p50 / single_p50, 2),
        "client": args.client,
        "requests": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.max_tokens,
        "max_num_seqs": args.max_num_seqs,
        "errors": len(errors),
        "error_kinds": dict(Counter(errors).most_common(5)),
        "single_p50_s": round(single_p50, 4),
        "load_p50_s": round(load_p50, 3),
        "load_p99_s": round(percentile(lat, 99), 3),
        "load_max_s": round(max(lat), 3),
        "engine_queue_mean_s": round(
            mean_delta(hist_before, hist_after, "vllm:request_queue_time_seconds"), 3
        ),
        "engine_e2e_mean_s": round(
            mean_delta(hist_before, hist_after, "vllm:e2e_request_latency_seconds"), 3
        ),
        "client_mean_s": round(statistics.fmean(lat), 3),
        "wall_s": round(wall_s, 3),
        "throughput_req_s": round(len(ok) / wall_s, 1),
        "throughput_tok_s": round(sum(o.tokens for o in ok) / wall_s, 1),
        # CPU seconds spent during the burst: this client, the API server process, the engine's processes
        "burst_cpu_s": {name: round(cpu_after[name] - cpu_before[name], 1) for name in procs},
        "load_average_1m": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny-qwen2", help="registry name or model directory")
    parser.add_argument("--client", choices=("aiohttp", "httpx"), default="aiohttp")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=1000, help="client connection limit")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--unloaded", type=int, default=20, help="sequential single requests (baseline)")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--max-num-seqs", type=int, default=256, help="server: sequences per step")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    args = parser.parse_args()

    from skylift.models import resolve_model_path

    args.model = str(resolve_model_path(args.model))
    log_path = Path(tempfile.mkdtemp(prefix="skylift_load_")) / "server.log"
    proc, url = start_server(args, log_path)
    try:
        result = asyncio.run(measure(url, args, proc.pid))
    finally:
        stop_server(proc)

    print(f"server log: {log_path}")
    print(
        f"{result['requests']} requests x {result['max_tokens']} tokens, {result['concurrency']} connections: "
        f"errors {result['errors']}, wall {result['wall_s']:.2f} s, "
        f"{result['throughput_req_s']} req/s, {result['throughput_tok_s']} tok/s"
    )
    print(
        f"latency under load: p50 {result['load_p50_s']:.3f} s, p99 {result['load_p99_s']:.3f} s, "
        f"max {result['load_max_s']:.3f} s; single unloaded request p50 {result['single_p50_s'] * 1000:.1f} ms; "
        f"ratio (p50 loaded / p50 unloaded) {result['ratio']}"
    )
    print(
        f"per request, mean: client {result['client_mean_s']:.3f} s, engine end-to-end "
        f"{result['engine_e2e_mean_s']:.3f} s of which queued {result['engine_queue_mean_s']:.3f} s"
    )
    print(f"CPU seconds during the burst: {result['burst_cpu_s']} (load average {result['load_average_1m']})")
    if result["errors"]:
        print(f"ERRORS: {result['error_kinds']}")
    print(json.dumps(result))
    return 1 if result["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
