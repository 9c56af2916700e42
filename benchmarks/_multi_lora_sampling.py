"""The sampling half of tinker_multi_lora.py: K LoRA samplers of one base in flight at once.

For one `--sampler-lora` mode, one fresh server: `MAX_K` rank-8 LoRA clients (the SDK's default
modules) take one training step each and save an ephemeral sampler. Then `REQUESTS` sample
requests of `TOKENS` tokens each (EOS ignored: every request makes exactly `TOKENS`), submitted at
once, go to one sampler alone, or round robin over K different samplers (K = 2, 4, 8). Each K runs
beside its own "alone" run in both orders (alone, K, K, alone); the best of each is kept (load on
a shared machine only slows a run). The server's stats say how the engine served the adapters.
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

from _servers import free_port, start_server, stop_server

API_KEY = "tml-dummy"
KS = (2, 4, 8)
MAX_K = max(KS)
REQUESTS, TOKENS = 8, 48
PROMPT = [1, 504, 3458, 282, 253, 1345, 7536, 30, 216]  # an arbitrary short prompt


def _sampling_stats(url: str) -> dict[str, Any]:
    req = urllib.request.Request(url + "/api/v1/server_stats", headers={"X-API-Key": API_KEY})
    with urllib.request.urlopen(req, timeout=10) as resp:
        engines = json.loads(resp.read())["sampling"]["engines"]
    return dict(engines[0]) if engines else {}


def _sample(samplers: list[Any], requests: int) -> float:
    """Tokens/s of `requests` requests spread round robin over `samplers`, all in flight at once."""
    from tinker import types

    params = types.SamplingParams(max_tokens=TOKENS, stop=[], temperature=1.0)
    prompt = types.ModelInput.from_ints(PROMPT)
    started = time.perf_counter()
    futures = [
        samplers[i % len(samplers)].sample(prompt, num_samples=1, sampling_params=params)
        for i in range(requests)
    ]
    tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
    return tokens / (time.perf_counter() - started)


def _logprob_gap(trainer: Any, sampler: Any) -> float:
    """Largest |sampler's teacher-forced logprob - the training forward's| on one sequence."""
    import numpy as np
    from tinker import types

    tokens = [*PROMPT, 1183, 314, 260, 1345, 30]
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )
    trained = np.asarray(
        trainer.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].data
    )
    sampled = np.asarray(
        sampler.compute_logprobs(types.ModelInput.from_ints(tokens)).result()[1:], dtype=float
    )
    return float(np.abs(trained - sampled).max())


def measure(model: str, rank: int, mode: str, batch: Any) -> dict[str, Any]:
    """One server with `--sampler-lora mode`; tokens/s alone and with K samplers, its stats."""
    import tinker
    from tinker import types

    work = Path(tempfile.mkdtemp(prefix=f"skylift_bench_lora_sampling_{mode}_"))
    port = free_port()
    cmd = [
        sys.executable, "-m", "skylift.tinker.commands", "serve", "--base-model", model,
        "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(work / "data"),
        "--log-level", "warning", "--sampler-lora", mode,
    ]  # fmt: skip
    proc, url = start_server(cmd, port, work / "server.log", 300.0, health_path="/api/v1/healthz")
    service = tinker.ServiceClient(base_url=url, api_key=API_KEY)
    alone: dict[int, list[float]] = {}
    together: dict[int, list[float]] = {}
    try:
        trainers, samplers = [], []
        for i in range(MAX_K):
            tc = service.create_lora_training_client(base_model=model, rank=rank, seed=i).result()
            tc.forward_backward(batch(i), "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
            trainers.append(tc)
            samplers.append(tc.save_weights_and_get_sampling_client().result())
        started = time.perf_counter()
        _sample(samplers[:1], 1)  # starts the engine (and, in auto mode, its measurement)
        start_s = time.perf_counter() - started
        _sample(samplers, MAX_K)  # every adapter seen once (loaded or merged) before timing
        for k in KS:
            runs = [_sample(samplers[:1], REQUESTS), _sample(samplers[:k], REQUESTS)]
            runs += [_sample(samplers[:k], REQUESTS), _sample(samplers[:1], REQUESTS)]
            alone[k], together[k] = [runs[0], runs[3]], [runs[1], runs[2]]
            print(f"  {mode}: K={k}: tokens/s alone {alone[k]}, K adapters at once {together[k]}", flush=True)
        gap = _logprob_gap(trainers[0], samplers[0])
        stats = _sampling_stats(url)
        service.close("success").result(timeout=60)
    finally:
        stop_server(proc, timeout_s=90)
    shutil.rmtree(work, ignore_errors=True)
    return {
        "mode": stats.get("mode"),
        "reason": stats.get("reason"),
        "calibration": stats.get("calibration"),
        "adapters": stats.get("adapters"),
        "adapts_unembedding": stats.get("adapts_unembedding"),
        "engine_start_s": round(start_s, 1),
        "alone_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in alone.items()},
        "together_tokens_per_s": {k: [round(x, 1) for x in v] for k, v in together.items()},
        "ratios": {k: round(max(together[k]) / max(alone[k]), 4) for k in KS},
        "best_alone": round(max(x for v in alone.values() for x in v), 1),
        "best_together": {k: round(max(together[k]), 1) for k in KS},
        "max_logprob_gap": gap,
    }


def sampling_summary(model: str, rank: int, batch: Any) -> dict[str, Any]:
    """Auto mode first (what it picks), then the other mode; ratios within each mode and of the
    picked mode's K samplers over the best one-sampler-alone figure of either mode."""
    auto = measure(model, rank, "auto", batch)
    other_mode = "swap" if auto["mode"] == "adapters" else "adapters"
    other = measure(model, rank, other_mode, batch)
    by_mode = {auto["mode"]: auto, other_mode: other}
    best_alone = max(auto["best_alone"], other["best_alone"])
    faster = {k: max(by_mode, key=lambda m: by_mode[m]["best_together"][k]) for k in KS}
    return {
        "sampling_ratio": round(auto["best_together"][MAX_K] / best_alone, 4),
        "auto_picked": auto["mode"],
        "faster_mode_at_k": faster,
        "sampling_ratios_within_mode": {m: r["ratios"] for m, r in by_mode.items()},
        "sampling_ratios_over_best_alone": {
            m: {k: round(r["best_together"][k] / best_alone, 4) for k in KS} for m, r in by_mode.items()
        },
        "sampling": by_mode,
        "sampling_requests": REQUESTS,
        "sampling_tokens_per_request": TOKENS,
    }
