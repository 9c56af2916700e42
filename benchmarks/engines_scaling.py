"""Rollout throughput with 1 and 2 local engines behind one `EnginePool` (least-loaded routing).

Each configuration runs in its own child process (vLLM reads its CPU binding from the environment
when it spawns the engine): in-process `LocalVLLMEngine`s, one warm-up batch, then the best of
`--rounds` timed batches of `--prompts` prompts x `--samples` samples of exactly `--max-tokens`
tokens (ignore_eos). Configurations:

- 1 engine on every core (skylift's default on a small CPU machine);
- 2 engines, each on every core (what `generator.num_inference_engines=2` does by default here);
- 2 engines, one core each (`VLLM_CPU_OMP_THREADS_BIND` set per engine; CPU only).

Prints a table and, last, one JSON line:
    {"ratio": tok_s(2 engines, default) / tok_s(1 engine), "ratio_pinned": ..., "cores": N, ...}

Run inside a loopback-only network namespace:
    bash scripts/loopback.sh .venv/bin/python benchmarks/engines_scaling.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from typing import Any

from _servers import set_benchmark_env

set_benchmark_env()

CONFIGS = {"1 engine": (1, False), "2 engines": (2, False), "2 engines, 1 core each": (2, True)}


async def measure(args: argparse.Namespace, engines: int, pinned: bool) -> dict[str, Any]:
    from skylift.inference.engine_args import apply_cpu_env_defaults
    from skylift.inference.local import LocalVLLMEngine
    from skylift.inference.pool import EnginePool
    from skylift.inference.types import SamplingParams
    from skylift.models import resolve_model_path

    model = resolve_model_path(args.model)
    cpus = sorted(os.sched_getaffinity(0))
    apply_cpu_env_defaults()
    started = time.perf_counter()
    members = []
    for i in range(engines):
        if pinned:  # the engine process inherits the environment when it is spawned
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(cpus[i % len(cpus)])
        members.append(
            await LocalVLLMEngine.create(
                model,
                name=f"engine-{i}",
                max_model_len=64 + args.max_tokens,
                dtype="float32",
                max_num_seqs=args.prompts * args.samples,
                enforce_eager=True,
                seed=i,
            )
        )
    startup_s = time.perf_counter() - started
    pool = EnginePool(members)
    prompts = [[(7 * p + 13 * j) % 1000 + 10 for j in range(32)] for p in range(args.prompts)]
    params = SamplingParams(max_tokens=args.max_tokens, n=args.samples, ignore_eos=True, temperature=1.0)
    try:
        await pool.generate(prompts[:2], params)  # warm-up
        times = []
        for _ in range(args.rounds):
            tick = time.perf_counter()
            outs = await pool.generate(prompts, params)
            times.append(time.perf_counter() - tick)
        tokens = sum(len(c.token_ids) for out in outs for c in out.completions)
    finally:
        await pool.close()
    return {
        "engines": engines,
        "pinned": pinned,
        "startup_s": startup_s,
        "best_s": min(times),
        "tokens": tokens,
        "tok_s": tokens / min(times),
        "served": pool.sequences_served,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--child", choices=list(CONFIGS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        engines, pinned = CONFIGS[args.child]
        print(json.dumps(asyncio.run(measure(args, engines, pinned))), flush=True)
        return

    cores = len(os.sched_getaffinity(0))
    results: dict[str, dict[str, Any]] = {}
    for name in CONFIGS:
        print(f"[bench] {name} ...", flush=True)
        cmd = [
            sys.executable,
            __file__,
            "--child",
            name,
            "--model",
            args.model,
            "--prompts",
            str(args.prompts),
        ]
        cmd += [
            "--samples",
            str(args.samples),
            "--max-tokens",
            str(args.max_tokens),
            "--rounds",
            str(args.rounds),
        ]
        out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True).stdout
        results[name] = json.loads(out.strip().splitlines()[-1])

    print(
        f"\n{args.model}: {args.prompts} prompts x {args.samples} samples x {args.max_tokens} tokens, {cores} cores"
    )
    print(f"{'configuration':<24} {'tok/s':>8} {'best s':>8} {'start s':>8}  sequences per engine")
    for name, r in results.items():
        print(f"{name:<24} {r['tok_s']:>8.1f} {r['best_s']:>8.2f} {r['startup_s']:>8.1f}  {r['served']}")
    base = results["1 engine"]["tok_s"]
    ratio = results["2 engines"]["tok_s"] / base
    pinned = results["2 engines, 1 core each"]["tok_s"] / base
    print(
        f"throughput ratio 2 engines / 1 engine: {ratio:.3f} (one core each: {pinned:.3f}) on {cores} cores"
    )
    print(
        json.dumps(
            {
                "ratio": round(ratio, 4),
                "ratio_pinned": round(pinned, 4),
                "cores": cores,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "model": args.model,
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
