"""One GRPO step in skylift against one in TRL's `GRPOTrainer`, side by side on this CPU.

Both sides train the same model (SmolLM2-135M-Instruct, fp32, from `skylift.models`) on the same
batch: the first `--num-prompts` (8) prompts of the addition demo (a chat with a worked example,
see `skylift.data.synthetic`), `--group-size` (4) sampled completions per prompt, at most
`--max-new-tokens` (64) new tokens, temperature 1, no KL term, GRPO advantages with std
normalisation, token-mean loss, lr `--lr` (5e-6), one optimizer step per step.

The timed step is a steady-state one: each side first runs `--warmup-steps` (1) untimed steps on
the same prompts (one epoch each), then the timed one, so that neither side's figure holds the
one-time costs of a fresh process (vLLM's and torch's first use of each batch shape, allocator
growth); `--warmup-steps=0` times the first step after start-up as before 2026-12-01. The warm-up
steps' times are reported beside the timed one.

- skylift: `RLTrainer` from the config API with the demo's float32 settings (the demo's bf16
  engine and mixed precision, used where the CPU has bf16 matrix instructions, are left out: both
  sides compute in float32), vLLM engine, policy worker, weight sync to the engine after each
  step. `setup()` (engine start-up, model load) is not timed; the step is `timing/step_s` of the
  last step of `fit()`. skylift runs twice, each in a child of its own: with every row
  trained (`trainer.skip_zero_advantage_rows=false`: the figure that does not depend on how many
  groups of the batch carry a reward signal; the JSON `ratio`) and with the default settings
  (rows whose advantages are all zero are skipped, exactly the same update; `ratio_default`).
- TRL: `GRPOTrainer` (HF generate, gradient checkpointing on, fp32, `use_cpu=True`) with one
  optimizer step per 8 x 4 completions. Building the trainer (model load) is not timed; the step
  is the time from the `on_step_begin` to the `on_step_end` callback of the last step of
  `train()` (generation, rewards, forward, backward, optimizer step).

Each run has its own child process, one after the other, so that their memory can be
measured apart (peak summed RSS of the child's process tree, sampled every 0.5 s: shared pages
count once per process, so the Ray/vLLM side is over-counted rather than under-counted; and peak
summed PSS, sampled every 2 s and at each new RSS high, since reading PSS costs CPU that the
measured side would miss).

Reward agreement: TRL's completions are scored again with skylift's ``arithmetic`` environment
and `skylift.envs.gsm8k_reward`; skylift's completions are scored with a TRL-style reward function
(`hash_answer_reward`, written here independently of skylift's parser) that implements the same
rule, for the timed step's completions and the warm-up steps' alike. Every pair must agree,
otherwise the script exits with status 1 after printing the summary.

Run (skylift starts Ray and vLLM, which must stay on a loopback-only network):
    unshare -n sh -c 'ip link set lo up; .venv/bin/python benchmarks/grpo_step_vs_trl.py'

Needs TRL in the environment (``pip install trl==1.16.0``; it brings datasets). The last stdout
line is one JSON object: {"ratio": skylift_step_s / trl_step_s (every row trained),
"ratio_default": skylift_default_step_s / trl_step_s, "skylift_step_s", "trl_step_s", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _grpo_common import MODEL, TreeMemorySampler, check_agreement
from _grpo_skylift import run_skylift
from _grpo_trl import run_trl

for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_HOST_IP": "127.0.0.1",
    "GLOO_SOCKET_IFNAME": "lo",
    "TOKENIZERS_PARALLELISM": "false",
    "WANDB_DISABLED": "true",
}.items():
    os.environ.setdefault(_key, _value)

#: skylift's two runs: every row trained (the headline `ratio`) and the default settings
SKY_RUNS = ("skylift", "skylift-default")


# ---- shared helpers ---------------------------------------------------------------------------


# ---- driver -----------------------------------------------------------------------------------


def _run_child(side: str, args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], TreeMemorySampler]:
    result_file = work / f"{side}_result.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--side", side, "--work", str(work)]
    cmd += [
        f"--num-prompts={args.num_prompts}",
        f"--group-size={args.group_size}",
        f"--max-new-tokens={args.max_new_tokens}",
        f"--lr={args.lr}",
        f"--seed={args.seed}",
        f"--trl-micro-batch={args.trl_micro_batch}",
        f"--trl-threads={args.trl_threads}",
        f"--warmup-steps={args.warmup_steps}",
    ]
    if args.skylift_gradient_checkpointing:
        cmd.append("--skylift-gradient-checkpointing")
    cmd += [f"--skylift-override={o}" for o in args.skylift_override]
    print(f"=== {side}: starting", flush=True)
    proc = subprocess.Popen(cmd, stdout=sys.stderr)
    sampler = TreeMemorySampler(proc.pid)
    sampler.start()
    try:
        rc = proc.wait(timeout=args.child_timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise RuntimeError(
            f"the {side} side did not finish within {args.child_timeout:.0f} s (--child-timeout)"
        ) from None
    finally:
        sampler.stop()
        leftovers = sampler.reap_leftovers()
        if leftovers:
            print(f"=== {side}: terminated leftover processes {leftovers}", file=sys.stderr, flush=True)
    if rc != 0 or not result_file.exists():
        raise RuntimeError(f"the {side} side failed (exit status {rc}); see its output above")
    return json.loads(result_file.read_text()), sampler


def _fmt_load(side: dict[str, Any]) -> str:
    start, end = side["loadavg_1min"]
    warm = ", ".join(f"{c:.1f}" for c in side["warmup_cpu_s"])
    return (
        f"CPU seconds of the process tree during the timed step {side['cpu_s']:.1f}"
        f"{f' (warm-up: {warm})' if warm else ''}; 1-min load average {start:.1f} at the start, "
        f"{end:.1f} at the end (2 cores, shared machine)"
    )


def _fmt_phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{k.removesuffix('_s')} {v:.1f}s" for k, v in phases.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--group-size", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--lr", type=float, default=5e-6)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--trl-micro-batch",
        type=int,
        default=32,
        help="TRL's per_device_train_batch_size; gradient accumulation makes up the rest of the batch",
    )
    parser.add_argument(
        "--trl-threads",
        type=int,
        default=0,
        help="torch intra-op threads in TRL's process (0 = torch's default, one per core). With the "
        "default, a loaded machine slows TRL's small per-token ops ~20x (threads wait on each other)",
    )
    parser.add_argument(
        "--skylift-gradient-checkpointing",
        action="store_true",
        help="turn on gradient checkpointing in skylift (the demo runs without it; TRL always has it on)",
    )
    parser.add_argument(
        "--skylift-override", action="append", default=[], help="extra key=value for skylift's config"
    )
    parser.add_argument(
        "--warmup-steps",
        type=int,
        default=1,
        help="steps each side runs before the timed one, on the same prompts (0: time the first step "
        "after start-up, which pays one-time costs: vLLM's and torch's first use of each shape)",
    )
    parser.add_argument(
        "--child-timeout",
        type=float,
        default=3600.0,
        help="seconds each side's child process may take, set-up included (a quiet run takes a few "
        "minutes; a loaded 2-core machine can take 20+ minutes per step)",
    )
    parser.add_argument("--order", choices=["skylift-first", "trl-first"], default="skylift-first")
    parser.add_argument("--side", choices=[*SKY_RUNS, "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.side is not None:  # child process: run one side, write its result
        work = args.work
        if args.side == "trl":
            result = run_trl(args, work)
        else:
            result = run_skylift(args, work, every_row=args.side == "skylift")
        (work / f"{args.side}_result.json").write_text(json.dumps(result))
        return 0

    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: .venv/bin/pip install trl==1.16.0", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="grpo_vs_trl_") as tmp:
        work = Path(tmp)
        sides = [*SKY_RUNS, "trl"] if args.order == "skylift-first" else ["trl", *SKY_RUNS]
        results: dict[str, dict[str, Any]] = {}
        memory: dict[str, TreeMemorySampler] = {}
        for side in sides:
            results[side], memory[side] = _run_child(side, args, work)
    return report(args, results, memory)


def _fmt_timed(side: dict[str, Any]) -> str:
    return f"step {len(side['warmup_step_s']) + 1} (timed)"


def _fmt_warmup(side: dict[str, Any]) -> str:
    if not side["warmup_step_s"]:
        return "no warm-up step"
    return "warm-up " + "; ".join(
        f"step {i + 1} {t:.1f} s ({_fmt_phases(p)})"
        for i, (t, p) in enumerate(zip(side["warmup_step_s"], side["warmup_phases"], strict=True))
    )


def _skylift_lines(label: str, sky: dict[str, Any], peak: float, peak_step: float, peak_pss: float) -> None:
    print(
        f"skylift ({label}): {_fmt_timed(sky)} {sky['step_s']:.1f} s ({_fmt_phases(sky['phases'])}); "
        f"{_fmt_warmup(sky)}; fit() "
        f"{sky['fit_s']:.1f} s; set-up {sky['setup_s']:.1f} s (not timed); gradient checkpointing "
        f"{'on' if sky['gradient_checkpointing'] else 'off'}"
    )
    print(
        f"    reward {sky['reward_mean']:.3f}, rows trained {sky['rows_trained_frac']:.0%} (rows whose "
        f"advantages are all zero have exactly zero gradient), response length mean "
        f"{sky['response_length_mean']:.1f} max {sky['response_length_max']:.0f}; peak summed RSS "
        f"{peak:.2f} GiB (during the step {peak_step:.2f}), peak summed PSS {peak_pss:.2f} GiB"
    )
    print(f"    {_fmt_load(sky)}")


def report(
    args: argparse.Namespace, results: dict[str, dict[str, Any]], memory: dict[str, TreeMemorySampler]
) -> int:
    """Print every run's figures and the reward agreement; the last line is the JSON summary.
    Returns 0 when the rewards agree, else 1."""
    sides = list(results)
    sky, default, trl_res = results["skylift"], results["skylift-default"], results["trl"]
    agreements = {run: check_agreement(results[run], trl_res) for run in SKY_RUNS}
    warmup_agreements = {
        run: check_agreement(results[run], trl_res, "warmup_completions") for run in SKY_RUNS
    }
    ratio = sky["step_s"] / trl_res["step_s"]
    ratio_default = default["step_s"] / trl_res["step_s"]
    gib = 2**30
    peak = {side: memory[side].peak() / gib for side in sides}
    peak_step = {side: memory[side].peak(*results[side]["window"]) / gib for side in sides}
    peak_pss = {side: memory[side].peak(pss=True) / gib for side in sides}

    n = args.num_prompts * args.group_size
    print()
    print(
        f"one GRPO step, {MODEL} fp32, {args.num_prompts} prompts x {args.group_size} samples, "
        f"<= {args.max_new_tokens} new tokens, lr {args.lr:g}, no KL"
    )
    for run, label in zip(SKY_RUNS, ("every row trained", "default settings"), strict=True):
        _skylift_lines(label, results[run], peak[run], peak_step[run], peak_pss[run])
    print(
        f"TRL {trl_res['trl_version']}: {_fmt_timed(trl_res)} {trl_res['step_s']:.1f} s "
        f"({_fmt_phases(trl_res['phases'])}); {_fmt_warmup(trl_res)}; train() {trl_res['train_s']:.1f} s; set-up {trl_res['setup_s']:.1f} s (not timed); "
        f"gradient checkpointing on, micro-batch {args.trl_micro_batch}, "
        f"{trl_res['torch_threads']} torch thread(s)"
    )
    print(
        f"    reward {trl_res['reward_mean']:.3f}, response length mean {trl_res['response_length_mean']:.1f} "
        f"max {trl_res['response_length_max']:.0f}; peak summed RSS {peak['trl']:.2f} GiB "
        f"(during the step {peak_step['trl']:.2f}), peak summed PSS {peak_pss['trl']:.2f} GiB"
    )
    print(f"    {_fmt_load(trl_res)}")
    for run, agreement in agreements.items():
        warm = warmup_agreements[run]
        print(
            f"reward agreement ({run}, timed step): TRL's {n} completions scored by skylift's arithmetic "
            f"env and gsm8k_reward: {agreement['trl_completions_scored_by_skylift']} agree; skylift's "
            f"scored by the TRL-style function: {agreement['skylift_completions_scored_by_trl_style']} "
            f"agree (warm-up steps: {warm['trl_completions_scored_by_skylift']} and "
            f"{warm['skylift_completions_scored_by_trl_style']})"
        )
        for m in agreement["mismatches"] + warm["mismatches"]:
            print(f"    MISMATCH {json.dumps(m)}")
    print(
        f"ratio skylift/TRL (step {args.warmup_steps + 1}, every row trained): {ratio:.3f} (goal <= 0.35); "
        f"with the default settings: {ratio_default:.3f}"
    )
    summary = {
        "ratio": round(ratio, 4),
        "ratio_default": round(ratio_default, 4),
        "skylift_step_s": round(sky["step_s"], 3),
        "skylift_default_step_s": round(default["step_s"], 3),
        "trl_step_s": round(trl_res["step_s"], 3),
        "warmup_steps": args.warmup_steps,
        "skylift_warmup_step_s": [round(t, 3) for t in sky["warmup_step_s"]],
        "skylift_default_warmup_step_s": [round(t, 3) for t in default["warmup_step_s"]],
        "trl_warmup_step_s": [round(t, 3) for t in trl_res["warmup_step_s"]],
        "skylift_warmup_phases_s": [{k: round(v, 3) for k, v in p.items()} for p in sky["warmup_phases"]],
        "trl_warmup_phases_s": [{k: round(v, 3) for k, v in p.items()} for p in trl_res["warmup_phases"]],
        "ratio_outer": round(sky["fit_s"] / trl_res["train_s"], 4),
        "skylift_fit_s": round(sky["fit_s"], 3),
        "trl_train_s": round(trl_res["train_s"], 3),
        "skylift_phases_s": {k: round(v, 3) for k, v in sky["phases"].items()},
        "skylift_default_phases_s": {k: round(v, 3) for k, v in default["phases"].items()},
        "trl_phases_s": {k: round(v, 3) for k, v in trl_res["phases"].items()},
        "skylift_peak_rss_gib": round(peak["skylift"], 3),
        "trl_peak_rss_gib": round(peak["trl"], 3),
        "skylift_step_peak_rss_gib": round(peak_step["skylift"], 3),
        "trl_step_peak_rss_gib": round(peak_step["trl"], 3),
        "skylift_peak_pss_gib": round(peak_pss["skylift"], 3),
        "skylift_default_peak_pss_gib": round(peak_pss["skylift-default"], 3),
        "trl_peak_pss_gib": round(peak_pss["trl"], 3),
        "skylift_step_cpu_s": round(sky["cpu_s"], 2),
        "skylift_default_step_cpu_s": round(default["cpu_s"], 2),
        "trl_step_cpu_s": round(trl_res["cpu_s"], 2),
        "skylift_warmup_step_cpu_s": [round(c, 2) for c in sky["warmup_cpu_s"]],
        "skylift_default_warmup_step_cpu_s": [round(c, 2) for c in default["warmup_cpu_s"]],
        "trl_warmup_step_cpu_s": [round(c, 2) for c in trl_res["warmup_cpu_s"]],
        "cpu_ratio": round(sky["cpu_s"] / max(trl_res["cpu_s"], 1e-9), 4),
        "skylift_loadavg": [round(x, 2) for x in sky["loadavg_1min"]],
        "skylift_default_loadavg": [round(x, 2) for x in default["loadavg_1min"]],
        "trl_loadavg": [round(x, 2) for x in trl_res["loadavg_1min"]],
        "skylift_reward_mean": round(sky["reward_mean"], 4),
        "skylift_default_reward_mean": round(default["reward_mean"], 4),
        "skylift_rows_trained_frac": round(sky["rows_trained_frac"], 4),
        "skylift_default_rows_trained_frac": round(default["rows_trained_frac"], 4),
        "trl_reward_mean": round(trl_res["reward_mean"], 4),
        "reward_agreement_trl_by_skylift": agreements["skylift"]["trl_completions_scored_by_skylift"],
        "reward_agreement_skylift_by_trl_style": {
            run: a["skylift_completions_scored_by_trl_style"] for run, a in agreements.items()
        },
        "reward_agreement_warmup_trl_by_skylift": warmup_agreements["skylift"][
            "trl_completions_scored_by_skylift"
        ],
        "reward_agreement_warmup_skylift_by_trl_style": {
            run: a["skylift_completions_scored_by_trl_style"] for run, a in warmup_agreements.items()
        },
        "rewards_agree": all(a["rewards_agree"] for a in [*agreements.values(), *warmup_agreements.values()]),
        "trl_version": trl_res["trl_version"],
        "trl_threads": trl_res["torch_threads"],
    }
    print(json.dumps(summary))
    return 0 if summary["rewards_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
