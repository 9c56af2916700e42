"""What K LoRA training clients of one base model cost a Tinker server, against one client.

One fresh `skylift tinker serve --base-model smollm2-135m-instruct` child process (the project's
registry model, fp32), driven with the real `tinker` SDK; rank-8 LoRA clients (attention, MLP and
unembedding, as the SDK's defaults). Clients are added one by one up to 8; each new one takes one
warm-up step (forward_backward + optim_step, so its gradients and optimizer state exist).

- memory: the PSS of the server's whole process tree (server and children, psutil) once K = 1, 2,
  4, 8 clients are warm; `memory_ratios[K]` = PSS(K) / PSS(1), target <= 1 + 0.1 (K - 1); also the
  growth over the idle server, (PSS(K) - idle) / (PSS(1) - idle);
- training throughput: `STEPS` steps of `ROWS` x `TOKENS` tokens, submitted at once, by one client
  alone, and spread over K clients interleaved (K = 2, 4, 8: every client's operations in flight
  together); `throughput_ratios[K]` = tokens/s of K interleaved over one alone, target >= 0.9.
  For each K the two run back to back in both orders (alone, K, K, alone) and the best run of
  each is compared: other load on a shared machine only slows a run down.
- sampling throughput (`_multi_lora_sampling.py`, two more servers): 8 sample requests of 48
  tokens in flight at once, to one LoRA sampler alone or round robin over K = 2, 4, 8 different
  ones; first with ``--sampler-lora auto`` (what the engine picks by its start-up measurement),
  then with the other mode (``adapters`` in the batch or ``swap``). `sampling_ratio` = tokens/s of
  8 samplers in auto's mode over the best one-sampler-alone tokens/s of either mode (target
  >= 0.8); the ratios within each mode, and which mode was faster at each K, are reported too.

Last line: JSON `{"ratio": memory ratio at K=8, "throughput_ratio": at K=8, "sampling_ratio":
..., ...}`.

Run (CPU machine: inside a loopback-only namespace, like every benchmark here):
    bash scripts/loopback.sh .venv/bin/python benchmarks/tinker_multi_lora.py
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import psutil
from _multi_lora_sampling import sampling_summary
from _servers import free_port, set_benchmark_env, start_server, stop_server

MODEL = "smollm2-135m-instruct"
API_KEY = "tml-dummy"
RANK = 8
KS = (1, 2, 4, 8)
STEPS, ROWS, TOKENS = 8, 2, 32
GIB = 1024**3


def tree_pss(pid: int) -> int:
    """PSS (bytes) of a process and all its descendants."""
    root = psutil.Process(pid)
    total = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            info = p.memory_full_info()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        total += getattr(info, "pss", info.rss)
    return total


def batch(offset: int) -> list[Any]:
    import numpy as np
    from tinker import types

    rows = [[10 + (offset * 13 + i * 7 + j * 3) % 900 for j in range(TOKENS + 1)] for i in range(ROWS)]
    return [
        types.Datum(
            model_input=types.ModelInput.from_ints(r[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(r[1:], dtype=np.int64),
                "weights": np.ones(TOKENS, dtype=np.float32),
            },
        )
        for r in rows
    ]


def train(clients: list[Any], steps: int) -> float:
    """Tokens/s of `steps` steps spread round robin over `clients`, all submitted at once."""
    from tinker import types

    adam = types.AdamParams(learning_rate=1e-4)
    started = time.perf_counter()
    futures = []
    for step in range(steps):
        client = clients[step % len(clients)]
        futures.append(client.forward_backward(batch(step), "cross_entropy"))
        futures.append(client.optim_step(adam))
    for future in futures:
        future.result()
    return steps * ROWS * TOKENS / (time.perf_counter() - started)


def stats(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url + "/api/v1/server_stats", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return dict(json.loads(resp.read())["training"])


def main() -> None:
    set_benchmark_env(TINKER_TELEMETRY="0")
    import tinker

    from skylift.models import prepare_model

    prepare_model(MODEL)  # built before any timing
    work = Path(tempfile.mkdtemp(prefix="skylift_bench_multi_lora_"))
    port = free_port()
    cmd = [
        sys.executable, "-m", "skylift.tinker.commands", "serve", "--base-model", MODEL,
        "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(work / "data"),
        "--log-level", "warning",
    ]  # fmt: skip
    proc, url = start_server(cmd, port, work / "server.log", 300.0, health_path="/api/v1/healthz")
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    pss: dict[int, int] = {}
    alone: dict[int, list[float]] = {}  # tokens/s of one client, run beside each K
    interleaved: dict[int, list[float]] = {}
    resident: dict[int, list[int]] = {}
    try:
        time.sleep(2.0)
        idle = tree_pss(proc.pid)
        clients: list[Any] = []
        for k in KS:
            while len(clients) < k:
                tc = service.create_lora_training_client(
                    base_model=MODEL, rank=RANK, seed=len(clients)
                ).result()
                train([tc], 1)  # warm: its gradients and optimizer state exist
                clients.append(tc)
            time.sleep(1.0)
            pss[k] = tree_pss(proc.pid)
            resident[k] = [b["lora_clients"] for b in stats(url)["resident_base_models"]]
            if k > 1:
                runs = [train(clients[:1], STEPS), train(clients, STEPS)]
                runs += [train(clients, STEPS), train(clients[:1], STEPS)]
                alone[k], interleaved[k] = [runs[0], runs[3]], [runs[1], runs[2]]
            print(
                f"K={k}: PSS {pss[k] / GIB:.3f} GiB (x{pss[k] / pss[1]:.3f} of one client), resident "
                f"bases (clients each) {resident[k]}; tokens/s alone {alone.get(k)}, "
                f"interleaved {interleaved.get(k)}",
                flush=True,
            )
        service.close("success").result(timeout=60)
    finally:
        stop_server(proc, timeout_s=90)
    shutil.rmtree(work, ignore_errors=True)
    memory_ratios = {k: round(pss[k] / pss[1], 4) for k in KS}
    growth = {k: round((pss[k] - idle) / (pss[1] - idle), 4) for k in KS}
    throughput_ratios = {k: round(max(interleaved[k]) / max(alone[k]), 4) for k in KS if k > 1}
    summary = {
        "ratio": memory_ratios[8],
        "throughput_ratio": throughput_ratios[8],
        "memory_ratios": memory_ratios,
        "memory_targets": {k: round(1 + 0.1 * (k - 1), 2) for k in KS},
        "memory_growth_ratios": growth,
        "throughput_ratios": throughput_ratios,
        "memory_ok": all(memory_ratios[k] <= 1 + 0.1 * (k - 1) for k in KS),
        "throughput_ok": all(r >= 0.9 for r in throughput_ratios.values()),
        "pss_gib": {k: round(v / GIB, 4) for k, v in pss.items()},
        "idle_pss_gib": round(idle / GIB, 4),
        "alone_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in alone.items()},
        "interleaved_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in interleaved.items()},
        "resident_base_clients": resident,
        "model": MODEL,
        "rank": RANK,
        "steps": STEPS,
        "tokens_per_step": ROWS * TOKENS,
    }
    print("sampling: K LoRA samplers in flight at once", flush=True)
    summary.update(sampling_summary(MODEL, RANK, batch))
    summary["sampling_ok"] = summary["sampling_ratio"] >= 0.8
    print(
        f"memory x{memory_ratios[8]:.3f} at K=8 (target <= 1.7), growth over idle x{growth[8]:.3f}; "
        f"throughput x{throughput_ratios[8]:.3f} at K=8 (target >= 0.9); sampling x"
        f"{summary['sampling_ratio']:.3f} at K=8 in {summary['auto_picked']} mode (target >= 0.8)"
    )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
