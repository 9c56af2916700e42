"""The gateway's cost: the same multi-turn tool task rolled out by skylift's own environment loop
and by an `openai`-client program through the gateway (`skylift.gateway`), on one engine.

The task is `skylift demo --task tools`'s (products with a calculator tool, xml calls, up to 3
turns of 40 tokens, SmolLM2-135M-Instruct): skylift's side is `Generator` stepping the row's
`calculator` environment; the gateway's is `HarnessRollouts` running
examples/harness_agent/calculator_agent.py (the demo's agent, no skylift import) with the same
environment as its verifier. Both get the same rows, sampling and seeds (sample j of a row: the
row's seed + j, turn / call k: + k x 1,000,003), on one in-process `LocalVLLMEngine`. Rounds
alternate between the sides (after one warm-up each; the prefix cache is reset before each), and
the best round of each is compared (other load only slows a round down); medians reported too.
Throughput is sampled tokens (the loss-masked ids) per second of the whole batch's rollouts.

It also compares what each side captured, rollout by rollout: the sampled ids of every turn, and
the whole sequence (prompt + response ids, where the gateway's calls merged into one).

Last line: JSON ``{"ratio": gateway_tok_s / loop_tok_s, "ids_identical": ..., ...}`` (goal >= 0.95,
identical ids).

Run (CPU machine: inside a loopback-only namespace):
    bash scripts/loopback.sh .venv/bin/python benchmarks/gateway_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from _servers import set_benchmark_env

AGENT = Path(__file__).resolve().parent.parent / "examples" / "harness_agent" / "calculator_agent.py"


def rollouts_of(trajectories: list[Any]) -> list[list[Any]]:
    """Trajectories grouped by rollout (uid, trajectory id), in order."""
    groups: dict[tuple[str, str], list[Any]] = {}
    for tr in trajectories:
        groups.setdefault((tr.uid, tr.trajectory_id or str(id(tr))), []).append(tr)
    return list(groups.values())


def sampled_ids(rollout: list[Any]) -> list[int]:
    return [t for tr in rollout for t, m in zip(tr.response_ids, tr.loss_mask, strict=True) if m]


def sequences(rollout: list[Any]) -> list[list[int]]:
    return [list(tr.prompt_ids) + list(tr.response_ids) for tr in rollout]


async def timed(side: Any, rows: list[Any], n: int, params: Any, seeds: list[int]) -> tuple[float, list[Any]]:
    start = time.perf_counter()
    out = await side.generate(rows, n, params, 0, seeds)
    return time.perf_counter() - start, out


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from skylift.data import PromptDataset
    from skylift.data.tool_demo import write_tool_demo
    from skylift.gateway.rollouts import HarnessRollouts, HarnessSettings
    from skylift.generator import Generator, GeneratorSettings
    from skylift.generator.generator import rollout_seed
    from skylift.inference.local import LocalVLLMEngine
    from skylift.inference.types import SamplingParams
    from skylift.models import resolve_model_path

    model = str(resolve_model_path(args.model))
    data = Path(tempfile.mkdtemp(prefix="skylift_bench_gateway_"))
    write_tool_demo(data, num_train=args.prompts, num_val=1, seed=0, worked_example="sum")
    rows = list(PromptDataset([data / "train.parquet"]))
    tokenizer = AutoTokenizer.from_pretrained(model)
    settings = GeneratorSettings(
        max_prompt_length=320,
        max_generate_length=args.max_tokens,
        max_turns=3,
        batched=False,
        default_env_class="calculator",
    )
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=args.max_tokens)
    seeds = [rollout_seed(0, 1, row.uid) for row in rows]
    engine = await LocalVLLMEngine.create(
        model,
        max_model_len=512,
        seed=0,
        dtype=args.dtype,
        enable_prefix_caching=True,
        max_num_seqs=args.prompts * args.samples,
    )
    loop_side = Generator(engine, tokenizer, settings)
    gateway_side = HarnessRollouts(
        Generator(engine, tokenizer, settings),
        HarnessSettings(
            entrypoint=f"{AGENT}:solve",
            verifier="env",
            tool_parser="xml",
            max_concurrent=args.prompts * args.samples,
        ),
        default_env_class="calculator",
    )
    sides = {"loop": loop_side, "gateway": gateway_side}
    rates: dict[str, list[float]] = {"loop": [], "gateway": []}
    captured: dict[str, list[list[Any]]] = {}
    try:
        for side in sides.values():  # warm-up
            await timed(side, rows, args.samples, params, seeds)
        for r in range(args.rounds):
            for name in ("loop", "gateway") if r % 2 == 0 else ("gateway", "loop"):
                await engine.reset_prefix_cache()
                seconds, out = await timed(sides[name], rows, args.samples, params, seeds)
                rollouts = rollouts_of(out)
                tokens = sum(len(sampled_ids(ro)) for ro in rollouts)
                rates[name].append(tokens / seconds)
                captured[name] = rollouts
                print(
                    f"round {r} {name:7s} {seconds:7.3f} s {tokens:5d} tokens {tokens / seconds:8.1f} tok/s",
                    flush=True,
                )
    finally:
        await gateway_side.aclose()
        await engine.close()
    loop_r, gate_r = captured["loop"], captured["gateway"]
    same_sampled = sum(sampled_ids(a) == sampled_ids(b) for a, b in zip(loop_r, gate_r, strict=True))
    same_sequence = sum(sequences(a) == sequences(b) for a, b in zip(loop_r, gate_r, strict=True))
    turns = {name: statistics.fmean(float(ro[-1].num_turns) for ro in rs) for name, rs in captured.items()}
    calls_loop = sum(max(ro[-1].num_turns, 1) for ro in loop_r)
    calls_gate = sum(int(ro[-1].metrics.get("harness_calls", 0)) for ro in gate_r)
    loop_best, gate_best = max(rates["loop"]), max(rates["gateway"])
    return {
        "ratio": round(gate_best / loop_best, 4),
        "ratio_median": round(statistics.median(rates["gateway"]) / statistics.median(rates["loop"]), 4),
        "ids_identical": same_sampled == len(loop_r) and same_sequence == len(loop_r),
        "rollouts": len(loop_r),
        "rollouts_same_sampled_ids": same_sampled,
        "rollouts_same_sequences": same_sequence,
        "model_calls": {"loop": calls_loop, "gateway": calls_gate},
        "turns_mean": {k: round(v, 3) for k, v in turns.items()},
        "loop_tok_s": round(loop_best, 1),
        "gateway_tok_s": round(gate_best, 1),
        "loop_rounds": [round(x, 1) for x in rates["loop"]],
        "gateway_rounds": [round(x, 1) for x in rates["gateway"]],
        "prompts": args.prompts,
        "samples": args.samples,
        "max_tokens": args.max_tokens,
        "model": args.model,
        "dtype": args.dtype,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    args = parser.parse_args()
    set_benchmark_env()
    print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
