"""Fully async vs sync GRPO on the demo's settings: mean step time and the reward curve of each.

Four child processes (fresh engine, same seed, same data each): sync and fully async
(`trainer.fully_async.enabled=true`, pause mode keep, TIS cap 2, `--workers` prompt groups in
flight, 16 by default: two batches, so the engine's batch stays full while groups finish), each
twice:
- pinned: the shape of a disaggregated GPU run, where generation and training have their own
  devices and hosts (sync and async alike). Placement `ray`: the engine is a Ray actor that owns
  vLLM's client (its per-step output processing in Python), the policy a Ray worker. The engine's
  processes (its actor and vLLM's engine core) run on one core, the engine's host; everything else
  on the other, the trainer's host: the policy's worker, the trainer's own process (the loop:
  rollouts' orchestration, scoring, the buffer, experience) and Ray's daemons. On a 2-core
  machine that is the only way overlap can help: unpinned, both already share every core, so
  fully async can only fill idle time;
- unpinned: the demo's own settings, everything where the OS puts it (placement `local`, the
  engine gets every core, as in `skylift demo`).

The demo's settings (`skylift.demo.DEMO_OVERRIDES`: SmolLM2-135M-Instruct, 8 prompts x 4 samples,
lr 1e-5) with <= 64 new tokens (the demo's cap when the figures were taken), fewer steps (8), no
evaluation and no checkpoints. The step time compared is the mean `timing/step_s` of steps
3..N-1, the steady state (step 1 of a fully async run generates its first batch with nothing to
overlap, step 2 still waits while the buffer fills up; the last has nothing to overlap), the same
steps for both modes. Also reported: each run's per-step phases, staleness and rewards.

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
import tempfile
from pathlib import Path
from typing import Any

from _runs import run_child, run_overrides, step_figures, timed_fit
from _servers import set_benchmark_env

set_benchmark_env()

PHASES = ("wait_s", "logprobs_s", "train_s", "weight_sync_s", "step_s")
#: steps left out of the mean before the steady state: step 1 of a fully async run generates its
#: first batch with nothing to overlap, step 2 still waits while the buffer fills up
WARMUP_STEPS = 2
MODES = ("sync", "async")


def overrides(args: argparse.Namespace, data: Path, run_dir: Path, mode: str, pinned: bool) -> list[str]:
    from skylift.demo import demo_overrides

    base = [
        o
        for o in demo_overrides(dynamic_sampling=False)
        if not o.startswith(("trainer.max_steps=", "trainer.eval", "generator.max_generate_length="))
    ]
    # 64 new tokens, the demo's rollout cap when the figures in RESULTS.md were taken
    extra = ["generator.max_generate_length=64"]
    extra += run_overrides(data, run_dir, f"fully_async_vs_sync_{mode}", args.steps)
    if pinned:  # the engine (and its client) in a Ray actor, the policy in a Ray worker
        extra.append("trainer.placement.backend=ray")
    if mode == "async":
        extra += [
            "trainer.fully_async.enabled=true",
            f"trainer.fully_async.max_staleness_steps={args.staleness}",
            f"trainer.fully_async.num_parallel_generation_workers={args.workers}",
            "trainer.fully_async.pause_mode=keep",
            "trainer.algorithm.use_tis=true",
            "trainer.algorithm.tis_imp_ratio_cap=2.0",
        ]
    return base + extra


def _set_affinity(pid: int, cpu: int) -> None:
    """Every thread of process `pid` on `cpu` (threads it starts later inherit it)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), {cpu})
        except OSError:  # a thread that just ended
            pass


def _cpus_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return line.split(":", 1)[1].strip()
    return "?"


def _pid_of(actor: Any) -> int:
    import ray

    return int(ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=60))


def pin_processes(rt: Any, trainer_cpu: int) -> dict[str, Any]:
    """After set-up, which started everything on the engine's core: only the engine side stays
    there (each engine actor, which owns vLLM's client, and its engine core process); everything
    else moves to `trainer_cpu`: the training workers (policy, and reference or critic when the
    run has them), this driver process (the loop: rollouts' orchestration, scoring, the buffer,
    experience; every thread, so threads it starts later follow) and Ray's daemons, as on the
    trainer's host of a disaggregated run. Returns where each process of the run may run."""
    import psutil

    engine_pids: set[int] = set()
    for ref in rt.engine_refs:
        pid = _pid_of(ref.actor)
        engine_pids |= {pid, *(c.pid for c in psutil.Process(pid).children(recursive=True))}
    workers = [w for group in (rt.policy, rt.ref, rt.critic) if group is not None for w in group.workers]
    training_pids = [_pid_of(w) for w in workers]
    where: dict[str, list[str]] = {}
    for proc in [psutil.Process(), *psutil.Process().children(recursive=True)]:
        try:
            if proc.pid not in engine_pids:
                _set_affinity(proc.pid, trainer_cpu)
            name = "trainer (driver)" if proc.pid == os.getpid() else proc.name()
            where.setdefault(f"{name} on {_cpus_of(proc.pid)}", []).append(str(proc.pid))
        except (psutil.Error, OSError):  # a process that just ended
            pass
    return {
        "trainer_cpu": trainer_cpu,
        "engine_pids": sorted(engine_pids),
        "training_worker_pids": training_pids,
        "processes": {key: len(members) for key, members in sorted(where.items())},
    }


def child(args: argparse.Namespace) -> None:
    """Run one mode and write its figures as JSON to `args.out`."""
    mode, pinned = args.child, args.pinned
    if pinned:
        # Everything the run starts (Ray's daemons, the engine actor with vLLM's client and
        # engine core, the policy's worker) inherits this process's core; the engine's compute
        # threads bind to it; set-up then moves the training workers to the trainer's core.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(args.engine_cpu)
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        os.environ["OMP_NUM_THREADS"] = "1"  # one core each: one torch thread each
        # Ray kills its largest worker (the policy's) at 95% of the machine's memory, which
        # other users of a shared machine may fill; the kernel's own limit still applies
        os.environ.setdefault("RAY_memory_usage_threshold", "0.99")
        _set_affinity(os.getpid(), args.engine_cpu)
    run_dir = Path(args.out).parent / f"{mode}-{'pinned' if pinned else 'free'}"
    rows, figures = timed_fit(
        overrides(args, Path(args.data), run_dir, mode, pinned),
        after_setup=(lambda runtime: {"placement": pin_processes(runtime, args.trainer_cpu)})
        if pinned
        else None,
    )
    figures.update(step_figures(rows, PHASES, warmup=WARMUP_STEPS))
    figures["token_staleness_mean"] = statistics.fmean(
        h.get("fully_async/token_staleness_mean", 0.0) for h in rows
    )
    figures["samples_spanning_versions"] = sum(
        h.get("fully_async/samples_spanning_versions", 0.0) for h in rows
    )
    Path(args.out).write_text(json.dumps(figures))


def run_mode(args: argparse.Namespace, mode: str, pinned: bool, data: Path, work: Path) -> dict[str, Any]:
    return run_child(
        __file__,
        f"{mode} ({'pinned' if pinned else 'unpinned'})",
        work / f"{mode}-{int(pinned)}.json",
        [
            *("--child", mode, "--data", str(data)),
            *("--steps", str(args.steps), "--staleness", str(args.staleness)),
            *("--workers", str(args.workers)),
            *("--trainer-cpu", str(args.trainer_cpu), "--engine-cpu", str(args.engine_cpu)),
            *(["--pinned"] if pinned else []),
        ],
        attempts=2,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--staleness", type=int, default=4, help="trainer.fully_async.max_staleness_steps")
    parser.add_argument(
        "--workers",
        type=int,
        default=16,
        help="trainer.fully_async.num_parallel_generation_workers (prompt groups in flight; the batch is 8)",
    )
    parser.add_argument("--trainer-cpu", type=int, default=0)
    parser.add_argument("--engine-cpu", type=int, default=1)
    parser.add_argument("--skip-unpinned", action="store_true", help="only the pinned pair (the ratio)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--pinned", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < WARMUP_STEPS + 2:
        parser.error(f"--steps must be >= {WARMUP_STEPS + 2} (steps {WARMUP_STEPS + 1}..N-1 are timed)")
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
    print(
        f"mean of steps {WARMUP_STEPS + 1}..{args.steps - 1} (seconds); fully async staleness bound "
        f"{args.staleness}, {args.workers} prompt groups in flight"
    )
    print(f"{'run':<16} " + " ".join(f"{p.removesuffix('_s'):>9}" for p in PHASES) + "  rewards per step")
    for key, pair in results.items():
        for mode, r in pair.items():
            cells = " ".join(f"{r['phases'][p]:>9.2f}" for p in PHASES)
            print(f"{mode + ' ' + key:<16} {cells}  {' '.join(f'{x:.2f}' for x in r['rewards'])}")
    ratios = {key: pair["async"]["step_s"] / pair["sync"]["step_s"] for key, pair in results.items()}
    medians = {
        key: pair["async"]["step_s_median"] / pair["sync"]["step_s_median"] for key, pair in results.items()
    }
    for key, ratio in ratios.items():
        print(f"step-time ratio fully async / sync, {key}: {ratio:.3f} (of the medians: {medians[key]:.3f})")
    print(
        json.dumps(
            {
                "ratio": round(ratios["pinned"], 4),
                "ratio_unpinned": round(ratios["unpinned"], 4) if "unpinned" in ratios else None,
                "ratio_of_medians": round(medians["pinned"], 4),  # report only: robust to one slow step
                "goal": "ratio <= 0.6 (pinned: engine and trainer on their own core)",
                "cores": os.cpu_count() or 0,
                "load_avg_1m": round(os.getloadavg()[0], 2),
                "steps": args.steps,
                "max_staleness_steps": args.staleness,
                "generation_workers": args.workers,
                "timed_steps": [WARMUP_STEPS + 1, args.steps - 1],
                **results,
            }
        )
    )


if __name__ == "__main__":
    main()
