"""What an SFT-only Tinker client saves by never starting an inference engine.

Each flow runs against a fresh `skylift tinker serve --base-model tiny-qwen2` child process, driven
with the real `tinker` SDK:

- sft: create_lora_training_client -> forward_backward (one small batch);
- sampling-first: create_lora_training_client -> save_weights_for_sampler -> create_sampling_client
  -> one sample (this starts the vLLM engine) -> forward_backward.

Measured per flow: seconds from create_lora_training_client to the first forward_backward result,
and the peak RSS and PSS of the server's whole process tree (server plus the engine's processes),
sampled every `--poll-s` while the flow runs. Rounds alternate the order of the two flows; the
best time of each flow is compared (other load on a shared machine only slows a round down), and
the peak memory is the largest seen in any round.

Last line: JSON `{"ratio": sft_s / sampling_first_s, "pss_ratio": ..., ...}`.

Run (CPU machine: inside a loopback-only namespace, gloo joins the engine):
    bash scripts/loopback.sh .venv/bin/python benchmarks/tinker_sft_startup.py
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _servers import free_port, set_benchmark_env
from _servers import start_server as start_server_process
from _servers import stop_server as stop_server_process

API_KEY = "tml-dummy"
GIB = 1024**3


def start_server(model: str, work: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """A fresh Tinker server with its own data directory; returns it once /healthz answers."""
    port = free_port()
    cmd = [
        sys.executable, "-m", "skylift.tinker.commands", "serve", "--base-model", model,
        "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(work / "data"),
        "--log-level", "warning",
    ]  # fmt: skip
    return start_server_process(cmd, port, work / "server.log", timeout_s, health_path="/api/v1/healthz")


def stop_server(proc: subprocess.Popen) -> None:
    stop_server_process(proc, timeout_s=90)


def server_status(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/skylift/status", timeout=10) as resp:
        return json.loads(resp.read())


@dataclass
class MemoryPeak:
    """Peak RSS and PSS (bytes) of a process and all its descendants, polled on a thread."""

    pid: int
    poll_s: float
    rss: int = 0
    pss: int = 0
    processes: int = 0
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> None:
        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss = pss = 0
        for p in procs:
            try:
                info = p.memory_full_info()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            rss += info.rss
            pss += getattr(info, "pss", info.rss)
        self.rss, self.pss = max(self.rss, rss), max(self.pss, pss)
        self.processes = max(self.processes, len(procs))

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.sample()

    def __enter__(self) -> MemoryPeak:
        self.sample()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.sample()


def sft_batch() -> list[Any]:
    """Four next-token rows of 24 tokens (the same small batch the Tinker tests train on)."""
    import numpy as np
    from tinker import types

    rows = [[5 + (i * 7 + j * 3) % 40 for j in range(24)] for i in range(4)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(r[1:], dtype=np.int64),
                "weights": np.ones(len(r) - 1, dtype=np.float32),
            },
        )
        for r in rows
    ]


def flow_sft(service: Any, model: str, marks: dict[str, float]) -> None:
    tc = service.create_lora_training_client(base_model=model, rank=8).result()
    marks["created"] = time.perf_counter()
    tc.forward_backward(sft_batch(), "cross_entropy").result()


def flow_sampling_first(service: Any, model: str, marks: dict[str, float]) -> None:
    from tinker import types

    tc = service.create_lora_training_client(base_model=model, rank=8).result()
    marks["created"] = time.perf_counter()
    path = tc.save_weights_for_sampler("first").result().path
    marks["saved"] = time.perf_counter()
    sampler = service.create_sampling_client(model_path=path).result()
    result = sampler.sample(
        types.ModelInput.from_ints([5, 8, 11, 14]), 1, types.SamplingParams(max_tokens=8, seed=0)
    ).result()
    if not result.sequences or not result.sequences[0].tokens:
        raise SystemExit("sampling-first: the sample came back empty")
    marks["sampled"] = time.perf_counter()
    tc.forward_backward(sft_batch(), "cross_entropy").result()


FLOWS: dict[str, Callable[[Any, str, dict[str, float]], None]] = {
    "sft": flow_sft,
    "sampling_first": flow_sampling_first,
}


def run_flow(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One flow on a fresh server: seconds to the first forward_backward, peak memory, phases."""
    import tinker

    work = Path(tempfile.mkdtemp(prefix=f"skylift_bench_{name}_"))
    t_server = time.perf_counter()
    proc, url = start_server(args.model, work, args.startup_timeout_s)
    server_start_s = time.perf_counter() - t_server
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    try:
        idle = MemoryPeak(proc.pid, args.poll_s)
        idle.sample()
        with MemoryPeak(proc.pid, args.poll_s) as peak:
            start = time.perf_counter()
            marks: dict[str, float] = {}
            FLOWS[name](service, args.model, marks)
            seconds = time.perf_counter() - start
        status = server_status(url)
        service.close("success").result(timeout=60)
    finally:
        stop_server(proc)
    shutil.rmtree(work, ignore_errors=True)  # kept (with server.log) only when the flow failed
    engines_started = sum(1 for e in status["engines"] if e["started"])
    if engines_started != (name == "sampling_first"):
        raise SystemExit(f"{name}: expected {int(name == 'sampling_first')} started engines, got {status}")
    phases = {k: round(v - start, 3) for k, v in marks.items()}
    return {
        "seconds": seconds,
        "peak_rss": peak.rss,
        "peak_pss": peak.pss,
        "idle_pss": idle.pss,
        "processes": peak.processes,
        "server_start_s": server_start_s,
        "phases": phases,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--poll-s", type=float, default=0.2, help="memory sampling interval")
    parser.add_argument("--startup-timeout-s", type=float, default=300.0)
    args = parser.parse_args()
    set_benchmark_env(TINKER_TELEMETRY="0")
    from skylift.models import prepare_model

    prepare_model(args.model)  # built before any timing

    results: dict[str, list[dict[str, Any]]] = {name: [] for name in FLOWS}
    for r in range(args.rounds):
        order = list(FLOWS) if r % 2 == 0 else list(reversed(FLOWS))
        for name in order:
            res = run_flow(name, args)
            results[name].append(res)
            print(
                f"round {r} {name:14s} {res['seconds']:7.2f} s to first forward_backward, "
                f"peak PSS {res['peak_pss'] / GIB:5.2f} GiB, RSS {res['peak_rss'] / GIB:5.2f} GiB "
                f"({res['processes']} processes), phases {res['phases']}",
                flush=True,
            )

    def best(name: str) -> float:
        return min(x["seconds"] for x in results[name])

    def peak(name: str, key: str) -> int:
        return max(x[key] for x in results[name])

    sft_s, samp_s = best("sft"), best("sampling_first")
    summary = {
        "ratio": round(sft_s / samp_s, 4),
        "pss_ratio": round(peak("sft", "peak_pss") / peak("sampling_first", "peak_pss"), 4),
        "rss_ratio": round(peak("sft", "peak_rss") / peak("sampling_first", "peak_rss"), 4),
        "sft_s": round(sft_s, 3),
        "sampling_first_s": round(samp_s, 3),
        "sft_peak_pss_gib": round(peak("sft", "peak_pss") / GIB, 3),
        "sampling_first_peak_pss_gib": round(peak("sampling_first", "peak_pss") / GIB, 3),
        "sft_peak_rss_gib": round(peak("sft", "peak_rss") / GIB, 3),
        "sampling_first_peak_rss_gib": round(peak("sampling_first", "peak_rss") / GIB, 3),
        "idle_server_pss_gib": round(min(x["idle_pss"] for r in results.values() for x in r) / GIB, 3),
        "sft_rounds_s": [round(x["seconds"], 3) for x in results["sft"]],
        "sampling_first_rounds_s": [round(x["seconds"], 3) for x in results["sampling_first"]],
        "sampling_first_phases": results["sampling_first"][0]["phases"],
        "server_start_s": round(min(x["server_start_s"] for r in results.values() for x in r), 3),
        "model": args.model,
        "rounds": args.rounds,
    }
    print(
        f"sft {sft_s:.2f} s vs sampling-first {samp_s:.2f} s (ratio {summary['ratio']:.3f}); "
        f"peak PSS {summary['sft_peak_pss_gib']:.2f} vs {summary['sampling_first_peak_pss_gib']:.2f} GiB "
        f"(ratio {summary['pss_ratio']:.3f})"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
