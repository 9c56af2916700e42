"""Weight-sync benchmark: trainer state dict -> running in-process vLLM engine, against baselines.

For each model (default: tiny-qwen2 and smollm2-135m-instruct) it measures, in one run:

- sync: `WeightSender.send_state_dict` of the whole (perturbed) state dict into a running
  `LocalVLLMEngine`, until every bucket is loaded and the prefix cache reset (the engine then
  serves the new weights; checked afterwards against transformers), by the overlapped weight
  stream (`weight_sync.broadcast.stream`, the default: one engine call per sync, bucket k+1 packed and
  broadcast while the engine reloads bucket k) and by the sequential path it replaced
  (`overlap=False`: one call, broadcast and reload per bucket), side by side; and by the stream
  with the engine loading through vLLM's generic reload instead of `weight_sync.broadcast.direct_load`
  (`stream_vllm_reload_s`: what the stream took before the direct load);
- raw_broadcast: ONE flat buffer of the same number of bytes broadcast over a gloo group between
  two plain processes (plus a one-element acknowledgement back, so the receiver has it all);
- reload: the engine's own in-place `reload_weights` of the same tensors, already in the worker's
  memory (no transfer at all);
- shm_sync: the same state dict by shared-memory handle (`weight_sync.ipc.transport.
  SharedTensorsTransport(keep_buffers=True)`: copied into kept /dev/shm buffers bucket by bucket
  while the workers load the buckets already there; what `weight_sync.topology`
  picks for a CPU engine on the trainer's host), beside the gloo stream (`shm_vs_gloo`: shm_sync_s
  / sync_s; checked against transformers like the stream, after a streamed push); and with new
  buffers each push (`keep_buffers=False`: `shm_fresh_sync_s`, `shm_fresh_vs_gloo`).

Prints one line per model and, last, a JSON line for the last model (SmolLM2-135M by default):
    {"ratio": sync_s / (raw_broadcast_s + reload_s), "sequential_ratio": sequential_sync_s / (...),
     "vs_raw_broadcast": sync_s / raw_broadcast_s, ...}
(goal: ratio <= 1.2 on a quiet machine). Buckets are the trainer's own size
(`skylift.cluster.worker_group.SYNC_BUCKET_MB`) unless `--bucket-mb` says otherwise. Rounds of the five measurements are interleaved, so that
load from other processes affects them alike; medians are reported.

Run inside a loopback-only network namespace (gloo's store listens on all interfaces):
    unshare -n sh -c 'ip link set lo up; .venv/bin/python benchmarks/weight_sync.py'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from _servers import set_benchmark_env

# VLLM_ALLOW_INSECURE_SERIALIZATION lets the reload baseline send a function to the worker through
# collective_rpc
set_benchmark_env(VLLM_ALLOW_INSECURE_SERIALIZATION="1")

import torch  # noqa: E402

from skylift.cluster.worker_group import SYNC_BUCKET_MB  # noqa: E402
from skylift.weight_sync.process_group import create_weight_sync_group  # noqa: E402

SEQUENCE = [5, 17, 230, 99, 42, 8, 77, 301, 12, 64]


# ---- baseline 1: raw single-buffer gloo broadcast between two plain processes ------------------


def _raw_receiver(port: int, numel: int, rounds: int, timeout_s: float) -> None:
    group = create_weight_sync_group(
        master_address="127.0.0.1",
        master_port=port,
        rank=1,
        world_size=2,
        group_name="raw_broadcast",
        backend="gloo",
        timeout_s=timeout_s,
    )
    buf = torch.empty(numel, dtype=torch.uint8)
    ack = torch.zeros(1)
    for _ in range(rounds):
        group.broadcast(buf, src=0)
        group.broadcast(ack, src=1)
    group.destroy()


class RawBroadcast:
    """Rank 0 of a two-process gloo group with a child process that receives `rounds` buffers."""

    def __init__(self, nbytes: int, rounds: int, timeout_s: float = 900.0) -> None:
        store = torch.distributed.TCPStore(
            "127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
        self.child = mp.get_context("spawn").Process(
            target=_raw_receiver, args=(store.port, nbytes, rounds, timeout_s)
        )
        self.child.start()
        self.group = create_weight_sync_group(
            master_address="127.0.0.1",
            master_port=store.port,
            rank=0,
            world_size=2,
            group_name="raw_broadcast",
            backend="gloo",
            timeout_s=timeout_s,
            store=store,
        )
        self.buf = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.ack = torch.zeros(1)

    def round(self) -> float:
        """Seconds to broadcast the buffer and get the receiver's acknowledgement back."""
        start = time.perf_counter()
        self.group.broadcast(self.buf, src=0)
        self.group.broadcast(self.ack, src=1)
        return time.perf_counter() - start

    def close(self) -> None:
        self.group.destroy()
        self.child.join(60)
        if self.child.is_alive():
            self.child.kill()


# ---- baseline 2: the engine's own in-place reload of tensors already in its memory -------------


def _reload_in_worker(worker: Any, model_dir: str) -> float:
    """Runs inside the vLLM worker: time `reload_weights` of the checkpoint, held in memory."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config

    weights = getattr(worker, "_bench_weights", None)
    if weights is None:
        weights = []
        for shard in sorted(Path(model_dir).glob("*.safetensors")):
            weights.extend(load_file(str(shard)).items())
        worker._bench_weights = weights
    start = time.perf_counter()
    with set_current_vllm_config(worker.vllm_config), torch.no_grad():
        worker.model_runner.reload_weights(weights_iterator=iter(weights))
    return time.perf_counter() - start


def _drop_reload_weights(worker: Any) -> None:
    worker._bench_weights = None


def _set_direct_load(worker: Any, enabled: bool) -> None:
    """Runs inside the vLLM worker: let the stream load with `weight_sync.broadcast.direct_load` or not."""
    getattr(worker, "worker", worker)._skylift_direct_load = enabled  # the worker, not its wrapper


# ---- the measured path -------------------------------------------------------------------------


def _engine_vs_hf(engine_lp: list[float], model: Any) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([SEQUENCE])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    ref = [logp[i - 1, t].item() for i, t in enumerate(SEQUENCE) if i > 0]
    return max(abs(a - b) for a, b in zip(engine_lp, ref, strict=True))


async def bench_model(name: str, repeats: int, bucket_bytes: int, enforce_eager: bool) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    from skylift.inference.local import LocalVLLMEngine
    from skylift.models import prepare_model
    from skylift.weight_sync import WeightSender
    from skylift.weight_sync.ipc.transport import SharedTensorsTransport

    model_dir = prepare_model(name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=gen) * 0.02)
    state = list(model.state_dict().items())
    nbytes = sum(t.numel() * t.element_size() for _, t in state)
    params = sum(t.numel() for _, t in state)

    start = time.perf_counter()
    engine = await LocalVLLMEngine.create(
        str(model_dir), max_model_len=512, dtype="float32", seed=0, enforce_eager=enforce_eager
    )
    startup_s = time.perf_counter() - start
    raw = RawBroadcast(nbytes, rounds=repeats + 1)
    try:
        before = (await engine.prompt_logprobs([SEQUENCE]))[0]
        sender = WeightSender(timeout_s=120.0)
        start = time.perf_counter()
        await sender.init_group([engine])
        init_s = time.perf_counter() - start
        rpc = engine.vllm_engine.collective_rpc
        # warm-up round of each path, then interleaved rounds so that load on the machine
        # affects the three measurements alike
        raw.round()
        await rpc(_reload_in_worker, args=(str(model_dir),))
        await sender.send_state_dict(state, bucket_bytes=bucket_bytes, overlap=False)
        await sender.send_state_dict(state, bucket_bytes=bucket_bytes, overlap=True)

        async def stream_with_vllm_reload() -> Any:
            await rpc(_set_direct_load, args=(False,))
            try:
                return await sender.send_state_dict(state, bucket_bytes=bucket_bytes, overlap=True)
            finally:
                await rpc(_set_direct_load, args=(True,))

        await stream_with_vllm_reload()
        shm = SharedTensorsTransport([engine], keep_buffers=True)  # kept buffers, streamed pushes
        fresh = SharedTensorsTransport([engine], keep_buffers=False)  # new buffers each push

        async def shm_sync(transport: SharedTensorsTransport = shm) -> float:
            transport.put(state)
            return (await transport.push(0))["timing/weight_sync_s"]

        await shm_sync(fresh)
        await shm_sync()
        await shm_sync()  # a streamed push into the kept buffers, checked below
        shm_err = _engine_vs_hf((await engine.prompt_logprobs([SEQUENCE]))[0], model)
        shm_fresh_times: list[float] = []
        raw_times, reload_times, sync_times, seq_times, vllm_times, buckets = [], [], [], [], [], 0
        shm_times: list[float] = []
        direct = 0
        for _ in range(repeats):
            raw_times.append(raw.round())
            reload_times.append((await rpc(_reload_in_worker, args=(str(model_dir),)))[0])
            seq = await sender.send_state_dict(state, bucket_bytes=bucket_bytes, overlap=False)
            seq_times.append(seq.seconds)
            stats = await sender.send_state_dict(state, bucket_bytes=bucket_bytes, overlap=True)
            if not stats.overlapped or stats.buckets != seq.buckets:
                raise SystemExit(f"{name}: the overlapped path was not taken ({stats})")
            sync_times.append(stats.seconds)
            buckets = stats.buckets
            direct = min(r.get("direct_buckets", 0) for r in stats.receipts)
            generic = await stream_with_vllm_reload()
            if any(r.get("direct_buckets") for r in generic.receipts):
                raise SystemExit(f"{name}: the stream with vLLM's reload loaded buckets directly ({generic})")
            vllm_times.append(generic.seconds)
            shm_times.append(await shm_sync())
            shm_fresh_times.append(await shm_sync(fresh))
        await rpc(_drop_reload_weights)
        await shm.close()
        await fresh.close()
        await sender.close()
        after = (await engine.prompt_logprobs([SEQUENCE]))[0]
    finally:
        raw.close()
        await engine.close()

    err_before, err_after = _engine_vs_hf(before, model), _engine_vs_hf(after, model)
    if not (err_after < err_before and err_after < 1e-2):
        raise SystemExit(f"{name}: the engine does not serve the synced weights ({err_before=} {err_after=})")
    if not (shm_err < err_before and shm_err < 1e-2):
        raise SystemExit(f"{name}: the engine does not serve the weights synced by handle ({shm_err=})")
    shm_s = statistics.median(shm_times)
    shm_fresh_s = statistics.median(shm_fresh_times)
    sync_s = statistics.median(sync_times)
    seq_s = statistics.median(seq_times)
    vllm_s = statistics.median(vllm_times)
    raw_s = statistics.median(raw_times)
    reload_s = statistics.median(reload_times)
    return {
        "model": name,
        "params": params,
        "bytes": nbytes,
        "buckets": buckets,
        "bucket_bytes": bucket_bytes,
        "sync_s": round(sync_s, 4),
        "sequential_sync_s": round(seq_s, 4),
        "stream_vllm_reload_s": round(vllm_s, 4),
        "direct_buckets": direct,
        "raw_broadcast_s": round(raw_s, 4),
        "shm_sync_s": round(shm_s, 4),
        "shm_vs_gloo": round(shm_s / sync_s, 3),
        "shm_fresh_sync_s": round(shm_fresh_s, 4),
        "shm_fresh_vs_gloo": round(shm_fresh_s / sync_s, 3),
        "logprob_err_after_shm_sync": shm_err,
        "reload_s": round(reload_s, 4),
        "init_group_s": round(init_s, 4),
        "engine_startup_s": round(startup_s, 1),
        "sync_gb_per_s": round(nbytes / sync_s / 1e9, 3),
        "raw_gb_per_s": round(nbytes / raw_s / 1e9, 3),
        "logprob_err_after_sync": err_after,
        "ratio": round(sync_s / (raw_s + reload_s), 3),
        "sequential_ratio": round(seq_s / (raw_s + reload_s), 3),
        "stream_vllm_reload_ratio": round(vllm_s / (raw_s + reload_s), 3),
        "speedup_vs_sequential": round(seq_s / sync_s, 3),
        "vs_raw_broadcast": round(sync_s / raw_s, 3),
        "repeats": repeats,
        "enforce_eager": enforce_eager,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny-qwen2,smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--bucket-mb",
        type=float,
        default=float(SYNC_BUCKET_MB),
        help=f"bucket size of the syncs (default: the trainer's own, {SYNC_BUCKET_MB} MB)",
    )
    parser.add_argument(
        "--enforce-eager",
        action="store_true",
        help="start the engine without compiling its model (faster start-up on a loaded machine; "
        "the weight reload is the same)",
    )
    args = parser.parse_args()
    results = []
    for name in args.models.split(","):
        result = asyncio.run(
            bench_model(name.strip(), args.repeats, int(args.bucket_mb * 1024 * 1024), args.enforce_eager)
        )
        results.append(result)
        print(
            f"{result['model']}: {result['bytes'] / 1e6:.1f} MB in {result['buckets']} bucket(s): "
            f"sync {1e3 * result['sync_s']:.1f} ms ({result['direct_buckets']} loaded directly; stream with "
            f"vLLM's reload {1e3 * result['stream_vllm_reload_s']:.1f} ms, "
            f"sequential {1e3 * result['sequential_sync_s']:.1f} ms) "
            f"| raw broadcast {1e3 * result['raw_broadcast_s']:.1f} ms "
            f"+ reload {1e3 * result['reload_s']:.1f} ms | ratio {result['ratio']:.2f} "
            f"(sequential {result['sequential_ratio']:.2f}) "
            f"(vs raw broadcast {result['vs_raw_broadcast']:.2f}) | group init {1e3 * result['init_group_s']:.0f} ms "
            f"| shared memory, kept buffers {1e3 * result['shm_sync_s']:.1f} ms ({result['shm_vs_gloo']:.2f} of "
            f"the gloo stream), new buffers {1e3 * result['shm_fresh_sync_s']:.1f} ms "
            f"({result['shm_fresh_vs_gloo']:.2f})",
            flush=True,
        )
    last = dict(results[-1])
    last["all"] = {
        r["model"]: {
            k: r[k]
            for k in (
                "sync_s",
                "sequential_sync_s",
                "stream_vllm_reload_s",
                "raw_broadcast_s",
                "reload_s",
                "ratio",
                "sequential_ratio",
                "shm_sync_s",
                "shm_vs_gloo",
                "shm_fresh_sync_s",
                "shm_fresh_vs_gloo",
            )
        }
        for r in results
    }
    print(json.dumps(last))


if __name__ == "__main__":
    sys.exit(main())
