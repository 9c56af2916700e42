"""SkyRL's per-parameter weight sync vs skylift's bucketed sync, into one `skylift serve` (CPU).

Into the same running server (SmolLM2-135M-Instruct by default, fp32), alternately:
- per_parameter: SkyRL 0.3.1's own trainer-side sender (`BroadcastWeightTransferSender` over
  `RemoteInferenceEngine`, the group built by SkyRL's `init_custom_process_group`): one HTTP
  `/update_weights` request per parameter, each posted concurrently with that tensor's broadcast;
  the server stages the parts of fused modules until complete;
- bucketed: skylift's `WeightSender` over its HTTP client: the state dict in buckets of at most
  `--bucket-mb`, one request and one flat broadcast per bucket.
After each sync the engine must serve the new weights (prompt logprobs against transformers).

Prints one line per round and, last, one JSON line:
    {"ratio": per_parameter_s / bucketed_s, "per_parameter_s", "bucketed_s", "requests", ...,
     "overhead_per_request_ms": (per_parameter_s - bucketed_s) / (requests - buckets)}

Needs the SkyRL client wheels that scripts/setup.sh downloads. Run inside a loopback-only network
namespace (gloo's store listens on all interfaces):
    bash scripts/loopback.sh .venv/bin/python benchmarks/skyrl_per_parameter_sync.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _servers import free_port, set_benchmark_env, start_server, stop_server

set_benchmark_env()

import torch  # noqa: E402

SEQUENCE = [5, 17, 230, 99, 42, 8, 77, 301, 12, 64]
ROOT = Path(__file__).resolve().parents[1]


def load_skyrl() -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    import skyrl_clients

    try:
        skyrl_clients.load()
    except BaseException as exc:  # pytest.skip's exception when the wheels are missing
        if type(exc).__name__ == "Skipped":
            raise SystemExit(str(exc)) from None
        raise


def logprob_error(url: str, model: Any) -> float:
    """Max |engine - transformers| over the prompt logprobs of SEQUENCE."""
    import urllib.request

    body = json.dumps(
        {"prompt_token_ids": [SEQUENCE], "sampling_params": {"max_tokens": 1}, "prompt_logprobs": True}
    ).encode()
    req = urllib.request.Request(
        url + "/skylift/generate", data=body, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as resp:
        engine = json.loads(resp.read())["outputs"][0]["prompt_logprobs"][1:]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([SEQUENCE])).logits[0].float(), dim=-1)
    ref = [logp[i - 1, t].item() for i, t in enumerate(SEQUENCE) if i > 0]
    return max(abs(a - b) for a, b in zip(engine, ref, strict=True))


def perturb(model: Any, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)


async def skyrl_sync(url: str, state: list[tuple[str, torch.Tensor]], model_dir: Path) -> tuple[float, float]:
    """(init seconds, sync seconds) of one SkyRL 0.3.1 per-parameter sync."""
    from omegaconf import OmegaConf
    from skyrl.backends.skyrl_train.distributed.utils import init_custom_process_group
    from skyrl_train.inference_engines.inference_engine_client import InferenceEngineClient
    from skyrl_train.inference_engines.remote_inference_engine import (
        RemoteWeightLoader,
        create_remote_inference_engines,
    )
    from skyrl_train.weight_sync import BroadcastInitInfo, BroadcastWeightTransferSender
    from skyrl_train.weight_sync.base import WeightChunk
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    engines = create_remote_inference_engines(
        urls=[url.removeprefix("http://")], model_name="m", engine_backend="vllm", tokenizer=tokenizer,
        tensor_parallel_size=1, pipeline_parallel_size=1, data_parallel_size=1,
    )  # fmt: skip
    cfg = OmegaConf.create(
        {
            "trainer": {"policy": {"model": {"path": "m"}}},
            "generator": {
                "backend": "vllm",
                "enable_http_endpoint": False,
                "http_endpoint_host": "",
                "http_endpoint_port": 0,
            },
        }
    )
    client = InferenceEngineClient(engines, tokenizer, cfg)
    info = BroadcastInitInfo(
        master_addr="127.0.0.1", master_port=free_port(), rank_offset=1, world_size=2, group_name="skyrl",
        backend="gloo", model_dtype_str="float32", override_existing_receiver=True,
    )  # fmt: skip
    start = time.perf_counter()
    group, answer = await asyncio.gather(
        asyncio.to_thread(
            init_custom_process_group,
            backend="gloo",
            init_method=f"tcp://127.0.0.1:{info.master_port}",
            world_size=2,
            rank=0,
            group_name="skyrl",
        ),  # fmt: skip
        client.init_weight_update_communicator(info),
    )
    init_s = time.perf_counter() - start
    sender = BroadcastWeightTransferSender(init_info=info, model_update_group=group, inference_client=client)
    chunks = [
        WeightChunk(names=[n], dtypes=["float32"], shapes=[list(t.shape)], tensors=[t]) for n, t in state
    ]
    start = time.perf_counter()
    await sender.send_chunks(chunks)
    sync_s = time.perf_counter() - start
    destroyed = await RemoteWeightLoader(url, "vllm").destroy_group()
    sender.teardown()
    if destroyed.get("status") != "ok":
        raise SystemExit(f"per-parameter sync left the server in error: {destroyed}")
    return init_s, sync_s


async def skylift_sync(
    url: str, state: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> tuple[float, float, int]:
    """(init seconds, sync seconds, buckets) of one skylift bucketed sync over HTTP."""
    from skylift.inference.remote import RemoteInferenceEngine
    from skylift.weight_sync import WeightSender

    engine = RemoteInferenceEngine(url, timeout_s=600.0)
    sender = WeightSender(timeout_s=300.0)
    start = time.perf_counter()
    await sender.init_group([engine])
    init_s = time.perf_counter() - start
    try:
        stats = await sender.send_state_dict(state, bucket_bytes=bucket_bytes)
    finally:
        await sender.close()
    return init_s, stats.seconds, stats.buckets


async def rounds(
    url: str, model: Any, model_dir: Path, repeats: int, bucket_bytes: int
) -> tuple[list[float], list[float], list[float], int, list[tuple[str, torch.Tensor]]]:
    """Alternate the two syncs `repeats` times (new weights each time, checked after each)."""
    per_param, bucketed, errors = [], [], []
    buckets = 0
    state: list[tuple[str, torch.Tensor]] = []
    for round_ in range(repeats):
        perturb(model, seed=2 * round_)
        state = [(n, t.detach().contiguous()) for n, t in model.state_dict().items()]
        _, s = await skyrl_sync(url, state, model_dir)
        per_param.append(s)
        errors.append(logprob_error(url, model))
        perturb(model, seed=2 * round_ + 1)
        state = [(n, t.detach().contiguous()) for n, t in model.state_dict().items()]
        _, b, buckets = await skylift_sync(url, state, bucket_bytes)
        bucketed.append(b)
        errors.append(logprob_error(url, model))
        print(
            f"round {round_ + 1}: per-parameter {s:.2f} s ({len(state)} requests) | bucketed {b:.2f} s "
            f"({buckets} bucket(s)) | logprob error after each {errors[-2]:.1e}, {errors[-1]:.1e}",
            flush=True,
        )
    return per_param, bucketed, errors, buckets, state


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=256.0)
    args = parser.parse_args()
    load_skyrl()
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from skylift.models import prepare_model

    model_dir = prepare_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tmp = Path(tempfile.mkdtemp(prefix="skyrl_bench_"))
    # SkyRL's sender needs the trainer's default process group (one rank here)
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'store'}", rank=0, world_size=1)
    port = free_port()
    cmd = [
        sys.executable, "-m", "skylift.inference.server", "--model", str(model_dir), "--port", str(port),
        "--dtype", "float32", "--max-model-len", "512", "--enforce-eager", "--seed", "0",
    ]  # fmt: skip
    started = time.perf_counter()
    proc, url = start_server(cmd, port, tmp / "server.log", timeout_s=900.0)
    startup_s = time.perf_counter() - started
    try:
        per_param, bucketed, errors, buckets, state = asyncio.run(
            rounds(url, model, model_dir, args.repeats, int(args.bucket_mb * 2**20))
        )
    finally:
        stop_server(proc)
        dist.destroy_process_group()
    if max(errors) > 1e-3:
        raise SystemExit(f"the engine does not serve the synced weights (logprob errors {errors})")
    p, b = statistics.median(per_param), statistics.median(bucketed)
    requests = len(state)
    result = {
        "ratio": round(p / b, 2),
        "per_parameter_s": round(p, 3),
        "bucketed_s": round(b, 3),
        "requests": requests,
        "buckets": buckets,
        "overhead_per_request_ms": round(1e3 * (p - b) / max(requests - buckets, 1), 2),
        "bytes": sum(t.numel() * t.element_size() for _, t in state),
        "model": args.model,
        "per_parameter_runs_s": [round(x, 3) for x in per_param],
        "bucketed_runs_s": [round(x, 3) for x in bucketed],
        "max_logprob_error": max(errors),
        "server_startup_s": round(startup_s, 1),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
