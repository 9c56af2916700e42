"""HTTP overhead of skylift's inference server: the same batch in-process vs through HTTP.

Both sides run the same engine settings (model, dtype, max_model_len, seed, max_num_seqs) and the
same batch (`--prompts` prompts x `--max-tokens` sampled tokens, ignore_eos so every request makes
exactly that many tokens). In-process is `LocalVLLMEngine` (vLLM's AsyncLLM in this process);
HTTP is `python -m skylift.inference.server` driven by an `EnginePool` of `RemoteInferenceEngine`s. Rounds alternate
between the two (after one warm-up each) so that machine noise hits both alike; the best round of
each side is compared (other load on a shared machine only slows rounds down), medians reported too.

Last line: JSON `{"ratio": http_tok_s / inproc_tok_s, ...}` (goal >= 0.95).

Run (CPU machine: inside a loopback-only namespace):
    unshare -n sh -c 'ip link set lo up; .venv/bin/python benchmarks/inference_http_overhead.py'
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _servers import free_port, set_benchmark_env, stop_server
from _servers import start_server as start_server_process


def start_server(model: str, args: argparse.Namespace, log_path: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "skylift.inference.server",
        "--model",
        model,
        "--port",
        str(port),
        "--dtype",
        args.dtype,
        "--max-model-len",
        str(args.max_model_len),
        "--seed",
        "0",
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--enable-prefix-caching",
        "--disable-uvicorn-access-log",
    ]
    return start_server_process(cmd, port, log_path, args.startup_timeout_s)


def make_prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    # Distinct prompts (no prefix sharing between them), deterministic.
    return [[(17 * i + 31 * j + 5) % (vocab - 10) + 5 for j in range(length)] for i in range(n)]


async def timed(engine, prompts, params) -> tuple[float, int]:
    start = time.perf_counter()
    outputs = await engine.generate(prompts, params)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.completions)
    return seconds, tokens


async def main_async(args: argparse.Namespace) -> dict:
    from skylift.inference.http_session import close_default_pool
    from skylift.inference.local import LocalVLLMEngine
    from skylift.inference.pool import EnginePool
    from skylift.inference.types import SamplingParams

    model = args.model
    try:
        from skylift.models import resolve_model_path

        model = str(resolve_model_path(model))
    except ImportError:
        pass

    params = SamplingParams(
        temperature=1.0, top_p=1.0, max_tokens=args.max_tokens, seed=None, ignore_eos=True
    )
    prompts = make_prompts(args.prompts, args.prompt_len, vocab=args.vocab)

    log_path = Path(tempfile.mkdtemp(prefix="skylift_bench_")) / "server.log"
    proc, url = start_server(model, args, log_path)
    local = None
    client = None
    try:
        local = await LocalVLLMEngine.create(
            model,
            max_model_len=args.max_model_len,
            seed=0,
            dtype=args.dtype,
            enable_prefix_caching=True,
            max_num_seqs=args.max_num_seqs,
        )
        client = EnginePool.from_urls([url])
        sides = {"inproc": local, "http": client}
        for engine in sides.values():  # warm-up
            await timed(engine, prompts, params)
        results: dict[str, list[float]] = {"inproc": [], "http": []}
        for r in range(args.rounds):
            order = ["inproc", "http"] if r % 2 == 0 else ["http", "inproc"]
            for side in order:
                await sides[side].reset_prefix_cache()
                seconds, tokens = await timed(sides[side], prompts, params)
                if tokens != args.prompts * args.max_tokens:
                    raise SystemExit(
                        f"{side}: expected {args.prompts * args.max_tokens} tokens, got {tokens}"
                    )
                results[side].append(tokens / seconds)
                print(f"round {r} {side:6s} {seconds:7.3f} s {tokens / seconds:9.1f} tok/s", flush=True)
    finally:
        if client is not None:
            await client.close()
            await close_default_pool()
        if local is not None:
            await local.close()
        stop_server(proc)

    # Other load on a shared machine only ever slows a round down, so the best round of each side
    # estimates its own speed; the medians are reported too.
    inproc, http = max(results["inproc"]), max(results["http"])
    inproc_med, http_med = statistics.median(results["inproc"]), statistics.median(results["http"])
    return {
        "ratio": round(http / inproc, 4),
        "ratio_median": round(http_med / inproc_med, 4),
        "http_tok_s": round(http, 1),
        "inproc_tok_s": round(inproc, 1),
        "http_tok_s_median": round(http_med, 1),
        "inproc_tok_s_median": round(inproc_med, 1),
        "http_rounds": [round(x, 1) for x in results["http"]],
        "inproc_rounds": [round(x, 1) for x in results["inproc"]],
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "prompt_len": args.prompt_len,
        "model": args.model,
        "dtype": args.dtype,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--max-num-seqs", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=1024, help="prompt token ids are drawn below this")
    parser.add_argument("--startup-timeout-s", type=float, default=420.0)
    args = parser.parse_args()
    set_benchmark_env()
    result = asyncio.run(main_async(args))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
