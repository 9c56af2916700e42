"""`python -m gpucheck` (run it through `scripts/gpu_check.sh`): the reference phase on CPU in a
child process, then every item on the device, a JSON report and a printed summary."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpucheck.colocated import ITEMS as COLOCATED_ITEMS
from gpucheck.env import (
    BLOCKED,
    CARRIED_WHEELS,
    add_wheels,
    import_skipping_package_init,
    install_blocker,
    loaded_blocked_modules,
)
from gpucheck.stack import stack_header

ITEMS = {
    "1": "TrainingWorker policy step (fp32, bf16, LoRA) vs CPU",
    "2": "FSDP2 (world size 1) + gradient checkpointing, fused AdamW, peak memory",
    "3": "weight sender: bf16 buckets packed on the device, broadcast, unpacked on CPU",
    "4": "one GRPO update from saved CPU rollouts vs CPU",
    "5": "Tinker training path (forward_backward + optim_step) vs CPU",
    # issue 53 (mixture-of-experts and vision-language models), no vLLM
    "moe": "tiny Qwen3-MoE: policy steps, routing replay, expert checkpoint names vs CPU",
    "vision": "tiny Qwen2-VL: a policy step on rows with images vs CPU",
    # issue 50 (a trainer and an engine on one GPU): torch alone, no model, no CPU reference
    **{key: title for key, (title, _) in COLOCATED_ITEMS.items()},
}
#: The items with models and a CPU reference phase (transformers and peft): issue 21's and 53's.
MODEL_ITEMS = ("1", "2", "3", "4", "5", "moe", "vision")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_check.sh", description=__doc__)
    p.add_argument("--cpu", action="store_true", help="run on CPU (scripts/gpu_check.sh hides CUDA)")
    p.add_argument("--work", type=Path, default=None, help="work directory (models, reference, rollouts)")
    p.add_argument("--out", type=Path, default=None, help="JSON report (default WORK/report.json)")
    p.add_argument("--wheels", type=Path, default=None, help="directory of pure-Python wheels to add")
    p.add_argument("--smollm2-layers", type=int, default=30, help="SmolLM2 depth (30 = the real one)")
    p.add_argument(
        "--items",
        default=",".join(ITEMS),
        help=f"comma-separated items (default all; torch-only: {','.join(COLOCATED_ITEMS)})",
    )
    p.add_argument("--phase", choices=("all", "reference"), default="all", help=argparse.SUPPRESS)
    p.add_argument("--reference-timeout", type=float, default=None, help="seconds for the CPU phase")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    blocker = install_blocker()
    # skylift.config's __init__ imports omegaconf (the loader), which the GPU machine lacks; the
    # worker and trainer modules need only the config's dataclasses (skylift.config.schema)
    import_skipping_package_init("skylift.config.schema", "skylift.config")
    args = parse(sys.argv[1:] if argv is None else argv)
    work = (args.work or Path(tempfile.gettempdir()) / f"skylift-gpu-check-{os.getuid()}").resolve()
    work.mkdir(parents=True, exist_ok=True)
    wheels = add_wheels(args.wheels, work / "site") if args.wheels else {}
    items = [i for i in args.items.split(",") if i]
    unknown = sorted(set(items) - set(ITEMS))
    if unknown:
        raise SystemExit(f"unknown items {unknown}; choose from {', '.join(ITEMS)}")

    started = time.perf_counter()
    import torch

    from gpucheck.device import Context, device_name, device_type

    torch.manual_seed(0)
    say = _printer()
    ctx: Any = None
    ref_s, refs = 0.0, {}
    if set(items) & set(MODEL_ITEMS):  # the models and the CPU reference phase
        from gpucheck.models import smollm2_dir, tiny_qwen2_dir

        ctx = Context(work, tiny_qwen2_dir(), smollm2_dir(work, args.smollm2_layers), args.smollm2_layers)
        if args.phase == "reference":
            return reference_phase(ctx, items)
    if args.cpu and torch.cuda.is_available():
        raise SystemExit("--cpu but CUDA is visible: run it through scripts/gpu_check.sh --cpu")
    if ctx is not None:
        say(f"models ready in {time.perf_counter() - started:.1f} s; CPU reference phase (child process) ...")
        ref_s, refs = run_reference(args, work, [i for i in items if i in MODEL_ITEMS])
        say(f"CPU reference done in {ref_s:.1f} s")
    say(f"device phase on {device_type()} ...")
    report_items = device_phase(ctx, refs, items, say)
    header: dict[str, Any] = {
        "device": device_type(),
        "device_name": device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": _version("transformers"),
        "peft": _version("peft"),
        "python": sys.version.split()[0],
        "smollm2_layers": args.smollm2_layers,
        "seconds": round(time.perf_counter() - started, 1),
        "reference_seconds": round(ref_s, 1),
        "reference_seconds_by_item": refs.get("seconds", {}),
        "blocked": sorted(blocker.names),
        "blocked_import_attempts": blocker.attempts,
        "blocked_modules_loaded": loaded_blocked_modules(),
        "wheels_added": wheels,
        "carried_wheels": [w for w, _, _ in CARRIED_WHEELS],
        "stack": stack_header(torch.__version__),
    }
    out = args.out or work / "report.json"
    header["report_path"] = str(out)
    from gpucheck.report import Item, print_summary, write_report

    audit = Item("imports", "nothing imported that the GPU machine lacks")
    audit.holds(
        "no blocked package loaded",
        not header["blocked_modules_loaded"],
        ", ".join(header["blocked_modules_loaded"]),
    )
    report = write_report(out, header, [*report_items, audit])
    print_summary(report, say)
    return 0 if report["ok"] else 1


def reference_phase(ctx: Any, items: list[str]) -> int:
    """Every item's CPU results into WORK/reference.pt; a failing part is recorded, not fatal."""
    import traceback

    import torch

    from gpucheck import grpo, moe, policy, tinker_path, vision

    parts = {
        "1,2": policy.reference,
        "4": grpo.reference,
        "5": tinker_path.reference,
        "moe": moe.reference,
        "vision": vision.reference,
    }
    refs: dict[str, Any] = {"errors": {}}
    for keys, fn in parts.items():
        if not set(keys.split(",")) & set(items):
            continue
        started = time.perf_counter()
        try:
            refs.update(fn(ctx))
        except Exception:
            for key in keys.split(","):
                refs["errors"][key] = "CPU reference failed:\n" + traceback.format_exc(limit=12)
            traceback.print_exc()
        refs.setdefault("seconds", {})[keys] = round(time.perf_counter() - started, 1)
        print(f"  cpu reference of item {keys}: {refs['seconds'][keys]:.1f} s", flush=True)
    torch.save(refs, ctx.work / "reference.pt")
    return 0


def run_reference(args: argparse.Namespace, work: Path, items: list[str]) -> tuple[float, dict[str, Any]]:
    import torch

    started = time.perf_counter()
    cmd = [sys.executable, "-m", "gpucheck", "--phase", "reference", "--work", str(work)]
    cmd += ["--smollm2-layers", str(args.smollm2_layers), "--items", ",".join(items)]
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    (work / "reference.pt").unlink(missing_ok=True)
    limit = args.reference_timeout or (1200.0 if args.cpu else 300.0)
    why = None
    try:
        done = subprocess.run(cmd, env=env, timeout=limit, check=False)
        if done.returncode != 0:
            why = f"the CPU reference phase failed (exit {done.returncode}); see its output above"
    except subprocess.TimeoutExpired:
        why = f"the CPU reference phase did not finish in {limit:.0f} s"
    if why is None:
        refs = torch.load(work / "reference.pt", weights_only=False)
    else:  # the items that need no reference (3) still run
        print(why, flush=True)
        refs = {"errors": {k: why for k in items if k != "3"}}
    return time.perf_counter() - started, refs


def device_phase(ctx: Any, refs: dict[str, Any], items: list[str], say: Any) -> list[Any]:
    from gpucheck.report import Item, running

    out: list[Item] = []
    keep: dict[str, Any] = {}
    for key in items:
        item = Item(key, ITEMS[key])
        with running(item):
            if key in refs.get("errors", {}):
                raise RuntimeError(refs["errors"][key])
            if key == "1":
                from gpucheck.policy import item_policy

                item_policy(ctx, refs, item, keep)
            elif key == "2":
                from gpucheck.policy import item_fsdp

                item_fsdp(ctx, refs, item, keep)
            elif key == "3":
                from gpucheck.weights import item_weights

                item_weights(ctx, item)
            elif key == "4":
                from gpucheck.grpo import item_grpo

                item_grpo(ctx, refs, item)
            elif key == "5":
                from gpucheck.tinker_path import item_tinker

                item_tinker(ctx, refs, item)
            elif key == "moe":
                from gpucheck.moe import item_moe

                item_moe(ctx, refs, item)
            elif key == "vision":
                from gpucheck.vision import item_vision

                item_vision(ctx, refs, item)
            else:
                COLOCATED_ITEMS[key][1](item)
        status = "SKIPPED" if item.skipped else "ok" if item.ok else "FAILED"
        say(f"  item {key} {status} in {item.seconds:.1f} s")
        out.append(item)
    return out


def _version(name: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return None


def _printer() -> Any:
    def say(text: str) -> None:
        print(text, flush=True)

    return say


__all__ = ["BLOCKED", "main"]

if __name__ == "__main__":
    sys.exit(main())
