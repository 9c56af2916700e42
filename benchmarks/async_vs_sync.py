"""Async vs sync GRPO: the same run with `trainer.async_training` false and true, side by side.

Each mode runs in its own child process (fresh engine, same seed, same data): GRPO on the
addition-demo task, in-process engine (placement backend "local"), no evaluation or checkpoints.
The step time compared is the mean `timing/step_s` of steps 2..N-1, the steady state
(`_runs.step_figures`): step 1 of an async run has nothing to overlap with (it generates its own
batch first) and step N has no next batch to generate, so both would flatter or penalise async
unfairly. Also reported: the per-step phases (generate, wait, train, sync, idle)
and the final sampled reward of both runs (async trains on rollouts one update old).

Prints a table and, last, one JSON line:
    {"ratio": async_step_s / sync_step_s, "sync": {...}, "async": {...}, "cores": N, ...}

Run inside a loopback-only network namespace (gloo's store listens on all interfaces):
    bash scripts/loopback.sh .venv/bin/python benchmarks/async_vs_sync.py
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from typing import Any

from _runs import run_child, run_overrides, step_figures, timed_fit
from _servers import set_benchmark_env

set_benchmark_env()

PHASES = ("generate_s", "wait_s", "logprobs_s", "train_s", "weight_sync_s", "idle_s", "step_s")


def overrides(args: argparse.Namespace, data: Path, run_dir: Path, mode: str) -> list[str]:
    return [
        *run_overrides(data, run_dir, f"async_vs_sync_{mode}", args.steps),
        f"trainer.policy.model.path={args.model}",
        f"trainer.async_training={mode == 'async'}",
        "trainer.max_staleness_steps=1",
        f"trainer.train_batch_size={args.prompts}",
        f"trainer.policy_mini_batch_size={args.prompts}",
        f"generator.n_samples_per_prompt={args.samples}",
        f"generator.max_generate_length={args.max_tokens}",
        "generator.sampling_params.temperature=1.0",
        f"trainer.policy.optimizer_config.lr={args.lr}",
        "trainer.policy.optimizer_config.weight_decay=0.0",
        f"trainer.micro_train_batch_size_per_gpu={args.prompts * args.samples}",
        f"trainer.micro_forward_batch_size_per_gpu={args.prompts * args.samples}",
        "trainer.placement.backend=local",
        "trainer.gradient_checkpointing=false",
        "trainer.max_prompt_length=128",
    ]


def child(args: argparse.Namespace) -> None:
    """Run one mode and write its figures as JSON to `args.out`."""
    run_dir = Path(args.out).parent / args.child
    rows, figures = timed_fit(overrides(args, Path(args.data), run_dir, args.child))
    Path(args.out).write_text(json.dumps({**figures, **step_figures(rows, PHASES)}))


def run_mode(args: argparse.Namespace, mode: str, data: Path, work: Path) -> dict[str, Any]:
    return run_child(
        __file__,
        mode,
        work / f"{mode}.json",
        [
            *("--child", mode, "--data", str(data)),
            *("--model", args.model, "--steps", str(args.steps), "--prompts", str(args.prompts)),
            *("--samples", str(args.samples), "--max-tokens", str(args.max_tokens), "--lr", str(args.lr)),
        ],
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--child", choices=("sync", "async"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (steps 2..N-1 are timed)")
    if args.child:
        child(args)
        return

    from skylift.data import write_addition_demo

    with tempfile.TemporaryDirectory(prefix="skylift-async-bench-") as tmp:
        work = Path(tmp)
        write_addition_demo(work / "data", num_train=max(64, args.steps * args.prompts), num_val=8, seed=0)
        results = {mode: run_mode(args, mode, work / "data", work) for mode in ("sync", "async")}

    print(f"\n{args.model}: {args.prompts} prompts x {args.samples} samples, <= {args.max_tokens} tokens, ")
    print(f"{args.steps} steps; mean of steps 2..{args.steps - 1} (seconds)")
    print(f"{'mode':<6} " + " ".join(f"{p.removesuffix('_s'):>11}" for p in PHASES) + "  final reward")
    for mode, r in results.items():
        cells = " ".join(f"{r['phases'][p]:>11.2f}" for p in PHASES)
        print(f"{mode:<6} {cells}  {r['final_reward']:.3f}")
    ratio = results["async"]["step_s"] / results["sync"]["step_s"]
    cores = os.cpu_count() or 0
    print(f"step-time ratio async/sync: {ratio:.3f} (goal <= 0.7 when generation ~ training; {cores} cores)")
    print(
        json.dumps(
            {
                "ratio": round(ratio, 4),
                "model": args.model,
                "cores": cores,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "steps": args.steps,
                "sync": results["sync"],
                "async": results["async"],
            }
        )
    )


if __name__ == "__main__":
    main()
