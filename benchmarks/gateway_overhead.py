"""The gateway's cost: the same multi-turn tool task rolled out by skylift's own environment loop
and by an `openai`-client program through the gateway (`skylift.gateway`), on one engine.

The task is `skylift demo --task tools`'s (products with a calculator tool, xml calls, up to 3
turns of 40 tokens, SmolLM2-135M-Instruct): skylift's side is `Generator` stepping the row's
`calculator` environment; the gateway's is `HarnessRollouts` running benchmarks/_gateway_env_agent.py
(an `openai`-client loop that handles each reply with the row's environment, as skylift's loop
does: same tool-call parsing, same error observations, same turn limit and stop rule). Both get
the same rows, sampling and seeds (sample j of a row: the row's seed + j, turn / call k:
+ k x 1,000,003), on one in-process `LocalVLLMEngine`. Rounds alternate between the sides (after
one warm-up each; the prefix cache is reset before each), and the best round of each is compared
(other load only slows a round down); medians reported too. Throughput is sampled tokens (the
loss-masked ids) per second of the whole batch's rollouts.

It also compares what each side did, rollout by rollout (a rollout is told by its seed): every
model call's prompt ids and sampled ids (recorded at the engine) and the trajectories' whole
sequences (prompt + response ids, the gateway's calls merged into one). For the first rollouts
that differ it prints each side's calls (prompt length, sampled ids) and where the prompts part.
A rollout is identical when its calls are, its trained ids are, and its sequences are up to its
last sampled id: skylift's loop ends a rollout that called a tool on its last allowed turn with
the tool's result and the next header (untrained, read by no call), which the gateway never gets
(the agent stops without sending them); `trailing_untrained` counts those rollouts and ids.

Last line: JSON ``{"ratio": gateway_tok_s / loop_tok_s, "ids_identical": "k/n",
"ids_identical_all": ..., ...}`` (goal >= 0.95, all identical).

Run (CPU machine: inside a loopback-only namespace):
    bash scripts/loopback.sh .venv/bin/python benchmarks/gateway_overhead.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from _servers import set_benchmark_env

AGENT = Path(__file__).resolve().parent / "_gateway_env_agent.py"
SHOWN = 4  # differing rollouts printed call by call


@dataclass
class Call:
    seed: int
    prompt_ids: list[int]
    sampled_ids: list[int]
    stop_reason: str


class RecordingEngine:
    """The engine, with every call's seed, prompt ids and sampled ids kept (both sides)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.calls: list[Call] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    async def generate(self, prompts: Any, params: Any, session_id: Any = None) -> Any:
        out = await self.engine.generate(prompts, params, session_id)
        for prompt, result in zip(prompts, out, strict=True):
            for c in result.completions:
                self.calls.append(Call(params.seed, list(prompt), list(c.token_ids), c.stop_reason))
        return out


def calls_by_rollout(calls: list[Call], rollout_seeds: set[int], stride: int) -> dict[int, list[Call]]:
    """Each rollout's calls in turn order (call k of a rollout samples with its seed + k x stride)."""
    out: dict[int, dict[int, Call]] = {}
    for call in calls:
        for k in range(64):
            if call.seed - k * stride in rollout_seeds:
                out.setdefault(call.seed - k * stride, {})[k] = call
                break
    return {seed: [turns[k] for k in sorted(turns)] for seed, turns in out.items()}


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


def trailing_untrained(rollout: list[Any]) -> int:
    """Untrained ids after the rollout's last sampled id: skylift's loop keeps the observations
    of a last turn (at max_turns) that called a tool, which no model call read; the gateway never
    sees them (the agent stops without sending them)."""
    mask = rollout[-1].loss_mask
    n = 0
    while n < len(mask) and not mask[len(mask) - 1 - n]:
        n += 1
    return n if n < len(mask) else 0


def sequences_to_last_sample(rollout: list[Any]) -> list[list[int]]:
    out = sequences(rollout)
    cut = trailing_untrained(rollout)
    if cut:
        out[-1] = out[-1][:-cut]
    return out


def explain(seed: int, loop: list[Call], gateway: list[Call], decode: Any) -> None:
    """Both sides' calls of one rollout, and where their prompts part."""
    print(f"rollout seed {seed}: loop {len(loop)} calls, gateway {len(gateway)} calls")
    for k in range(max(len(loop), len(gateway))):
        for name, calls in (("loop", loop), ("gateway", gateway)):
            if k >= len(calls):
                print(f"  call {k} {name:7s} (none)")
                continue
            c = calls[k]
            print(
                f"  call {k} {name:7s} prompt {len(c.prompt_ids):4d} ids, sampled {len(c.sampled_ids):3d} "
                f"({c.stop_reason}): {c.sampled_ids[:8]}... {decode(c.sampled_ids)!r}"
            )
        if k < min(len(loop), len(gateway)) and loop[k].prompt_ids != gateway[k].prompt_ids:
            a, b = loop[k].prompt_ids, gateway[k].prompt_ids
            j = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
            print(f"    prompts part at id {j}: loop ...{decode(a[j - 8 : j + 24])!r}")
            print(f"    {'':24s}gateway ...{decode(b[j - 8 : j + 24])!r}")


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
    from skylift.generator.settings import TURN_SEED_STRIDE
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
    engine = RecordingEngine(
        await LocalVLLMEngine.create(
            model,
            max_model_len=512,
            seed=0,
            dtype=args.dtype,
            enable_prefix_caching=True,
            max_num_seqs=args.prompts * args.samples,
        )
    )
    loop_side = Generator(engine, tokenizer, settings)
    gateway_side = HarnessRollouts(
        Generator(engine, tokenizer, settings),
        HarnessSettings(
            entrypoint=f"{AGENT}:solve",
            options={"env_class": "calculator", "max_turns": settings.max_turns},
            tool_parser="xml",
            max_concurrent=args.prompts * args.samples,
        ),
        default_env_class="calculator",
    )
    sides = {"loop": loop_side, "gateway": gateway_side}
    rates: dict[str, list[float]] = {"loop": [], "gateway": []}
    captured: dict[str, list[list[Any]]] = {}
    calls: dict[str, list[Call]] = {}
    try:
        for side in sides.values():  # warm-up
            await timed(side, rows, args.samples, params, seeds)
        for r in range(args.rounds):
            for name in ("loop", "gateway") if r % 2 == 0 else ("gateway", "loop"):
                await engine.reset_prefix_cache()
                engine.calls = []
                seconds, out = await timed(sides[name], rows, args.samples, params, seeds)
                rollouts = rollouts_of(out)
                tokens = sum(len(sampled_ids(ro)) for ro in rollouts)
                rates[name].append(tokens / seconds)
                captured[name], calls[name] = rollouts, engine.calls
                print(
                    f"round {r} {name:7s} {seconds:7.3f} s {len(engine.calls):3d} calls {tokens:5d} tokens "
                    f"{tokens / seconds:8.1f} tok/s",
                    flush=True,
                )
    finally:
        await gateway_side.aclose()
        await engine.close()
    rollout_seeds = {seed + j for seed in seeds for j in range(args.samples)}
    by_seed = {name: calls_by_rollout(c, rollout_seeds, TURN_SEED_STRIDE) for name, c in calls.items()}
    same_calls = 0
    shown = 0
    for seed in sorted(rollout_seeds):
        loop_calls, gate_calls = by_seed["loop"].get(seed, []), by_seed["gateway"].get(seed, [])
        key = [(c.prompt_ids, c.sampled_ids) for c in loop_calls]
        if key == [(c.prompt_ids, c.sampled_ids) for c in gate_calls]:
            same_calls += 1
        elif shown < SHOWN:
            shown += 1
            explain(seed, loop_calls, gate_calls, lambda ids: tokenizer.decode(ids))
    loop_r, gate_r = captured["loop"], captured["gateway"]
    same_sampled = sum(sampled_ids(a) == sampled_ids(b) for a, b in zip(loop_r, gate_r, strict=True))
    same_sequence = sum(sequences(a) == sequences(b) for a, b in zip(loop_r, gate_r, strict=True))
    same_to_last = sum(
        sequences_to_last_sample(a) == sequences_to_last_sample(b)
        for a, b in zip(loop_r, gate_r, strict=True)
    )
    trailing = {name: [trailing_untrained(ro) for ro in rs] for name, rs in captured.items()}
    identical = sum(
        sampled_ids(a) == sampled_ids(b) and sequences_to_last_sample(a) == sequences_to_last_sample(b)
        for a, b in zip(loop_r, gate_r, strict=True)
    )
    all_identical = identical == len(loop_r) == same_calls == len(rollout_seeds)
    if not all_identical:
        print(f"IDS DIFFER: {identical}/{len(loop_r)} rollouts identical", file=sys.stderr, flush=True)
    turns = {name: statistics.fmean(float(ro[-1].num_turns) for ro in rs) for name, rs in captured.items()}
    loop_best, gate_best = max(rates["loop"]), max(rates["gateway"])
    return {
        "ratio": round(gate_best / loop_best, 4),
        "ratio_median": round(statistics.median(rates["gateway"]) / statistics.median(rates["loop"]), 4),
        "ids_identical": f"{identical}/{len(loop_r)}",
        "ids_identical_all": all_identical,
        "rollouts": len(loop_r),
        "rollouts_same_calls": same_calls,
        "rollouts_same_sampled_ids": same_sampled,
        "rollouts_same_sequences": same_sequence,
        "rollouts_same_sequences_to_last_sample": same_to_last,
        "trailing_untrained": {
            name: {"rollouts": sum(1 for n in ns if n), "ids": sum(ns)} for name, ns in trailing.items()
        },
        "model_calls": {name: len(c) for name, c in calls.items()},
        "sampled_tokens": {name: sum(len(c.sampled_ids) for c in cs) for name, cs in calls.items()},
        "max_prompt_ids": {name: max(len(c.prompt_ids) for c in cs) for name, cs in calls.items()},
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
