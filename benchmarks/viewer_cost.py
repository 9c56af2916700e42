"""What recording rollouts for `skylift view` costs on the demo: the demo's run with the default
`trainer.rollout_records` settings and with recording off (`interval=0`), side by side.

Each runs in its own child process (a fresh engine, the same seed and data): the demo's exact
configuration (`skylift.demo.demo_overrides()`: SmolLM2-135M, 8 prompts x 4 samples, dynamic
sampling, prefix sharing, one process) for `--steps` steps without evaluation. The demo trains
with one on-policy update a step, so it has no PPO-anchor logprob pass: at step 1 (and every
`logprob_interval`-th step after) the recorder runs a forward pass of its recorded rows.

Figures, over steps 2..N-1: the recorder's own time per step (`timing/rollout_records_s`, measured
inside the run) over the step time of the same steps (the ratio; goal < 0.02); step 1's recorder
time (with the forward pass, and the prompt index built once) and the ratio with it spread over
`logprob_interval` steps; the step times of both runs (their difference is within the noise of a
shared machine).

    bash scripts/loopback.sh .venv/bin/python benchmarks/viewer_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from _runs import run_child, run_overrides, step_figures, timed_fit
from _servers import set_benchmark_env

set_benchmark_env()

PHASES = ("generate_s", "logprobs_s", "train_s", "weight_sync_s", "rollout_records_s", "step_s")


def overrides(data: Path, run_dir: Path, mode: str, steps: int) -> list[str]:
    from skylift.demo import demo_overrides

    return [
        *demo_overrides(),
        *run_overrides(data, run_dir, f"viewer_cost_{mode}", steps),
        f"trainer.rollout_records.interval={1 if mode == 'records' else 0}",
    ]


def child(args: argparse.Namespace) -> None:
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # the demo sizes its KV cache itself (0.4 GiB)
    run_dir = Path(args.out).parent / args.child
    rows, figures = timed_fit(overrides(Path(args.data), run_dir, args.child, args.steps))
    timed = rows[1:-1] or rows
    records = [h.get("timing/rollout_records_s", 0.0) for h in timed]
    figures["records_over_step"] = sum(records) / sum(h["timing/step_s"] for h in timed)
    figures["records_s_median"] = statistics.median(records)
    figures["step1_records_s"] = rows[0].get("timing/rollout_records_s", 0.0)
    folder = run_dir / "logs" / "rollouts"
    figures["records_bytes"] = sum(p.stat().st_size for p in folder.glob("*.json")) if folder.is_dir() else 0
    Path(args.out).write_text(json.dumps({**figures, **step_figures(rows, PHASES)}))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--child", choices=("records", "off"), help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from skylift.data import write_addition_demo

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="skylift-viewer-bench-") as tmp:
        work = Path(tmp)
        write_addition_demo(work / "data", num_train=max(200, args.steps * 16), num_val=8, seed=0)
        for mode in ("records", "off"):
            extra = ["--child", mode, "--data", str(work / "data"), "--steps", str(args.steps)]
            results[mode] = run_child(__file__, mode, work / f"{mode}.json", extra)
    print(f"\nthe demo's configuration, {args.steps} steps; mean of steps 2..{args.steps - 1} (seconds)")
    print(f"{'mode':<8} " + " ".join(f"{p.removesuffix('_s'):>16}" for p in PHASES))
    for mode, r in results.items():
        print(f"{mode:<8} " + " ".join(f"{r['phases'][p]:>16.3f}" for p in PHASES))
    ratio = results["records"]["records_over_step"]
    from skylift.config.records import RolloutRecordsConfig

    every = RolloutRecordsConfig().logprob_interval
    r = results["records"]
    spread = (r["records_s_median"] + r["step1_records_s"] / every) / r["step_s"]
    print(
        f"step 1's recording (its forward pass): {r['step1_records_s']:.3f} s; spread over {every} steps: {spread:.2%}"
    )
    print(
        f"recording: {ratio:.2%} of the step time (goal < 2%), "
        f"{results['records']['records_bytes'] / 1024:.0f} KiB for {args.steps} steps; "
        f"step time with / without: {results['records']['step_s'] / results['off']['step_s']:.3f}"
    )
    cores = os.cpu_count() or 0
    summary = {
        "ratio": round(ratio, 4),
        "ratio_with_forward_spread": round(spread, 4),
        "step_ratio_with_over_without": round(results["records"]["step_s"] / results["off"]["step_s"], 4),
        "cores": cores,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "steps": args.steps,
        "records": results["records"],
        "off": results["off"],
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
