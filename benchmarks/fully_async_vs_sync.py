"""Fully async vs sync GRPO on the demo's settings: mean step time and the reward curve of each.

Four child processes (fresh engine, same seed, same data each): sync and fully async
(`trainer.fully_async.enabled=true`, pause mode keep, TIS cap 2), each twice:
- pinned: the engine's processes (and, in a fully async run, the thread driving its client's
  event loop) on one core and the trainer on another (sync and async alike),
  the shape of a disaggregated GPU run, where generation and training have their own devices;
  on a 2-core machine that is the only way overlap can help: unpinned, both already share every
  core, so fully async can only fill idle time;
- unpinned: everything where the OS puts it (the engine gets every core, as in `skylift demo`).

The demo's settings (`skylift.demo.DEMO_OVERRIDES`: SmolLM2-135M-Instruct, 8 prompts x 4 samples,
<= 64 tokens, lr 1e-5) with fewer steps, no evaluation and no checkpoints. The step time compared
is the mean `timing/step_s` of steps 2..N-1 (step 1 of a fully async run fills the buffer; the
last has nothing to overlap). Also reported: each run's per-step phases, staleness and rewards.

Prints a table and, last, one JSON line:
    {"ratio": pinned async_step_s / sync_step_s, "ratio_unpinned": ..., "pinned": {...}, ...}

Run inside a loopback-only network namespace (gloo's store listens on all interfaces):
    bash scripts/loopback.sh .venv/bin/python benchmarks/fully_async_vs_sync.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _servers import set_benchmark_env

set_benchmark_env()

PHASES = ("wait_s", "logprobs_s", "train_s", "weight_sync_s", "step_s")
MODES = ("sync", "async")


def overrides(args: argparse.Namespace, data: Path, run_dir: Path, mode: str) -> list[str]:
    from skylift.demo import demo_overrides

    base = [o for o in demo_overrides() if not o.startswith(("trainer.max_steps=", "trainer.eval"))]
    extra = [
        f"data.train_data=['{data / 'train.parquet'}']",
        "data.val_data=[]",
        f"trainer.run_name=fully_async_vs_sync_{mode}",
        f"trainer.max_steps={args.steps}",
        "trainer.eval_before_train=false",
        "trainer.eval_interval=-1",
        "trainer.hf_save_interval=-1",
        f"trainer.ckpt_path={run_dir / 'ckpts'}",
        f"trainer.export_path={run_dir / 'exports'}",
        f"trainer.log_dir={run_dir / 'logs'}",
        "trainer.logger=console",
    ]
    if mode == "async":
        extra += [
            "trainer.fully_async.enabled=true",
            f"trainer.fully_async.max_staleness_steps={args.staleness}",
            "trainer.fully_async.pause_mode=keep",
            "trainer.algorithm.use_tis=true",
            "trainer.algorithm.tis_imp_ratio_cap=2.0",
        ]
    return base + extra


def _threads(pid: int) -> list[int]:
    try:
        return [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return []


def pin(trainer_cpu: int, engine_cpu: int) -> dict[str, Any]:
    """Every thread of this process on `trainer_cpu`, every thread of its descendants (the
    engine's core and worker processes) on `engine_cpu`."""
    import psutil
    import torch

    children = psutil.Process().children(recursive=True)
    for proc in children:
        for tid in _threads(proc.pid):
            try:
                os.sched_setaffinity(tid, {engine_cpu})
            except OSError:
                pass
    for tid in _threads(os.getpid()):
        try:
            os.sched_setaffinity(tid, {trainer_cpu})
        except OSError:
            pass
    torch.set_num_threads(1)
    threading.Thread(target=_pin_engine_client, args=(engine_cpu,), daemon=True).start()
    return {"trainer_cpu": trainer_cpu, "engine_cpu": engine_cpu, "engine_processes": len(children)}


def _pin_engine_client(engine_cpu: int) -> None:
    """The thread that drives the event loop of a fully async run (the engine client's output
    processing, the generation workers, scoring) runs beside the engine, as an engine's front end
    does on its own host; a sync run drives that loop from the trainer's thread between updates."""
    pinned: set[int] = set()
    while True:
        for thread in threading.enumerate():
            if thread.name.startswith("skylift-fully-async") and thread.native_id not in pinned:
                try:
                    os.sched_setaffinity(thread.native_id, {engine_cpu})  # type: ignore[arg-type]
                    pinned.add(thread.native_id)  # type: ignore[arg-type]
                except OSError:
                    pass
        time.sleep(0.2)


def child(args: argparse.Namespace) -> None:
    """Run one mode and write its figures as JSON to `args.out`."""
    mode, pinned = args.child, args.pinned
    if pinned:  # the engine's compute threads bind to their own core from the start
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(args.engine_cpu)
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    from skylift.config import load_config
    from skylift.trainer.loop import RLTrainer

    run_dir = Path(args.out).parent / f"{mode}-{'pinned' if pinned else 'free'}"
    trainer = RLTrainer(load_config(overrides(args, Path(args.data), run_dir, mode)), console=True)
    placement: dict[str, Any] = {}
    try:
        started = time.perf_counter()
        trainer.setup()
        setup_s = time.perf_counter() - started
        if pinned:
            placement = pin(args.trainer_cpu, args.engine_cpu)
        started = time.perf_counter()
        history = trainer.fit()
        fit_s = time.perf_counter() - started
    finally:
        trainer.shutdown()
    rows = [h for h in history if "reward/mean" in h]
    timed = rows[1:-1] or rows
    Path(args.out).write_text(
        json.dumps(
            {
                "setup_s": round(setup_s, 2),
                "fit_s": round(fit_s, 2),
                "step_s": statistics.fmean(h["timing/step_s"] for h in timed),
                "step_times": [round(h["timing/step_s"], 3) for h in rows],
                "phases": {p: statistics.fmean(h.get(f"timing/{p}", 0.0) for h in timed) for p in PHASES},
                "rewards": [round(h["reward/mean"], 4) for h in rows],
                "staleness_max": max(h["async/staleness_max"] for h in rows),
                "token_staleness_mean": statistics.fmean(
                    h.get("fully_async/token_staleness_mean", 0.0) for h in rows
                ),
                "samples_spanning_versions": sum(
                    h.get("fully_async/samples_spanning_versions", 0.0) for h in rows
                ),
                "placement": placement,
            }
        )
    )


def run_mode(args: argparse.Namespace, mode: str, pinned: bool, data: Path, work: Path) -> dict[str, Any]:
    out = work / f"{mode}-{int(pinned)}.json"
    cmd = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--out",
        str(out),
        "--data",
        str(data),
        *("--steps", str(args.steps), "--staleness", str(args.staleness)),
        *("--trainer-cpu", str(args.trainer_cpu), "--engine-cpu", str(args.engine_cpu)),
        *(["--pinned"] if pinned else []),
    ]
    print(f"[bench] {mode} ({'pinned' if pinned else 'unpinned'}) ...", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--staleness", type=int, default=4, help="trainer.fully_async.max_staleness_steps")
    parser.add_argument("--trainer-cpu", type=int, default=0)
    parser.add_argument("--engine-cpu", type=int, default=1)
    parser.add_argument("--skip-unpinned", action="store_true", help="only the pinned pair (the ratio)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--pinned", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 3:
        parser.error("--steps must be >= 3 (steps 2..N-1 are timed)")
    if args.child:
        child(args)
        return
    cpus = sorted(os.sched_getaffinity(0))
    if not {args.trainer_cpu, args.engine_cpu} <= set(cpus) or args.trainer_cpu == args.engine_cpu:
        parser.error(f"--trainer-cpu and --engine-cpu must be two different cores of {cpus}")

    from skylift.data import write_addition_demo

    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="skylift-fully-async-bench-") as tmp:
        work = Path(tmp)
        # fully async samples up to (staleness + 1) batches ahead of training
        write_addition_demo(
            work / "data", num_train=8 * (args.steps + args.staleness + 2) * 2, num_val=8, seed=0
        )
        for pinned in (True, False) if not args.skip_unpinned else (True,):
            key = "pinned" if pinned else "unpinned"
            results[key] = {mode: run_mode(args, mode, pinned, work / "data", work) for mode in MODES}

    print(f"\nSmolLM2-135M demo settings (8 prompts x 4 samples, <= 64 tokens), {args.steps} steps; ")
    print(f"mean of steps 2..{args.steps - 1} (seconds); fully async staleness bound {args.staleness}")
    print(f"{'run':<16} " + " ".join(f"{p.removesuffix('_s'):>9}" for p in PHASES) + "  rewards per step")
    for key, pair in results.items():
        for mode, r in pair.items():
            cells = " ".join(f"{r['phases'][p]:>9.2f}" for p in PHASES)
            print(f"{mode + ' ' + key:<16} {cells}  {' '.join(f'{x:.2f}' for x in r['rewards'])}")
    ratios = {key: pair["async"]["step_s"] / pair["sync"]["step_s"] for key, pair in results.items()}
    for key, ratio in ratios.items():
        print(f"step-time ratio fully async / sync, {key}: {ratio:.3f}")
    print(
        json.dumps(
            {
                "ratio": round(ratios["pinned"], 4),
                "ratio_unpinned": round(ratios["unpinned"], 4) if "unpinned" in ratios else None,
                "goal": "ratio <= 0.6 (pinned: engine and trainer on their own core)",
                "cores": os.cpu_count() or 0,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "steps": args.steps,
                "max_staleness_steps": args.staleness,
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
