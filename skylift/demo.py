"""`skylift demo`: GRPO on SmolLM2-135M-Instruct learning a task on CPU, in minutes.

`--task addition` (the default): two-digit addition. The prompt is a chat with one worked example
(23 + 45 = 68, then `#### 68`) followed by the question; the reward is 1 when the last `#### n` is
the right sum.

`--task tools`: agentic RL. Products of a two- and a three-digit number, which the model cannot
work out in its head, with a calculator tool (`skylift.envs.calculator`, `skylift.data.tool_demo`; the
prompt shows one solved problem, a small sum by default):
multi-turn rollouts through the generator's agent loop, tool calls parsed and run by the
environment, the result back as a `tool` message, then the answer.

The demo evaluates greedy accuracy on 100 held-out problems before and after training, prints a
before/after table (with the tool-call rate for `tools`) and writes a plot of reward and accuracy
per step. Any `key=value` override of `skylift train` applies on top of the demo's settings.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skylift.utils.eval_stats import format_accuracy

# dynamic sampling (DAPO `filter`): each step generates 16 prompts x 4 samples in one call and
# trains on up to 8 of the groups whose 4 rewards differ (without it few groups carry a signal);
# one call of 64 sequences costs less than two rounds of 32 (benchmarks/RESULTS.md)
DYNAMIC_SAMPLING_OVERRIDES = [
    "trainer.algorithm.dynamic_sampling.type=filter",
    "trainer.algorithm.dynamic_sampling.gen_batch_size=16",
    "trainer.algorithm.dynamic_sampling.max_sample_batches=1",
]

DEMO_OVERRIDES = [
    "trainer.policy.model.path=smollm2-135m-instruct",
    "trainer.run_name=demo",
    "trainer.algorithm.advantage_estimator=grpo",
    # TRL's anchor batch: 8 prompts x 4 samples; evaluation answers in up to 64 new tokens as
    # there, rollouts in up to 40 (a right answer is shorter; a rare rambling sample no longer
    # keeps the whole batch decoding: benchmarks/RESULTS.md)
    "trainer.train_batch_size=8",
    "trainer.policy_mini_batch_size=8",
    "generator.n_samples_per_prompt=4",
    "generator.max_generate_length=40",
    "generator.eval_sampling_params.max_generate_length=64",
    "generator.sampling_params.temperature=1.0",
    # 26 steps at 1e-5 decaying linearly to 0 (the figures of these and other settings:
    # benchmarks/RESULTS.md)
    "trainer.policy.optimizer_config.lr=1e-5",
    "trainer.policy.optimizer_config.scheduler=linear",
    "trainer.policy.optimizer_config.weight_decay=0.0",
    "trainer.max_steps=26",
    *DYNAMIC_SAMPLING_OVERRIDES,
    # prefix sharing: each micro-batch computes its distinct prefixes once (the prompts' shared
    # system message and worked example, each group's prompt, identical samples), so a step
    # trains in less CPU time (benchmarks/RESULTS.md)
    "trainer.share_prefixes=true",
    "trainer.micro_train_batch_size_per_gpu=16",
    "trainer.micro_forward_batch_size_per_gpu=16",
    # one process: no Ray daemons, the engine's client and the policy share memory
    "trainer.placement.backend=local",
    "trainer.gradient_checkpointing=false",
    "trainer.eval_before_train=true",
    "trainer.eval_interval=10",
    "trainer.eval_batch_size=100",
    "trainer.ckpt_interval=-1",
    "trainer.resume_mode=none",
    "trainer.max_prompt_length=128",
    "generator.max_num_seqs=128",
    # 0.4 GiB of KV cache holds a step's 64 sequences (their prompts sharing a prefix) and the
    # evaluation's 100 (the token counts: benchmarks/RESULTS.md); the cache is resident, so a
    # smaller one is that much less memory
    "generator.kv_cache_gb=0.4",
    # vLLM's CPU KV blocks are 128 tokens by default, so a 90-token prompt fills no block the
    # prefix cache could share; with 32-token blocks the prompts' shared 64 tokens and each group's
    # prompt are prefilled once (a step generates faster: benchmarks/RESULTS.md)
    "generator.kv_cache_block_size=32",
]

# `--task tools`, on top of the above: 3 turns (call the calculator, read its result, answer, or
# one more call after an error), rollouts of up to 40 new tokens a turn in evaluation too (a call
# takes ~20, an answer ~6), context up to 320 tokens (136-token prompts with the product example),
# a KV cache for the longer conversations (the figures of these and other settings:
# benchmarks/RESULTS.md, "Tool-use demo")
TOOL_TASK_OVERRIDES = [
    "trainer.run_name=demo-tools",
    "generator.batched=false",
    "generator.max_turns=3",
    "generator.eval_sampling_params.max_generate_length=40",
    "trainer.max_prompt_length=320",
    "generator.kv_cache_gb=0.6",
    "trainer.micro_train_batch_size_per_gpu=8",  # the longer sequences' logits: peak memory under 8 GiB
    "trainer.max_steps=10",  # within 10 minutes of training on 2 cores (benchmarks/RESULTS.md)
]

# `--task harness`, on top of the tools task's: the same calculator task, but the agent is an ordinary
# `openai`-client program (examples/harness_agent/calculator_agent.py, no skylift import) that
# skylift reaches only through the gateway (`skylift.gateway`); the row's `calculator` environment
# scores its final answer, tool calls are read in the prompt's xml format
HARNESS_AGENT = Path(__file__).resolve().parent.parent / "examples" / "harness_agent" / "calculator_agent.py"
HARNESS_TASK_OVERRIDES = [
    "trainer.run_name=demo-harness",
    f"environment.harness.entrypoint={HARNESS_AGENT}:solve",
    "environment.harness.verifier=env",
    "environment.harness.tool_parser=xml",
    "environment.harness.max_concurrent=64",  # a step's 16 prompts x 4 samples at once
]

DEMO_TASKS = ("addition", "tools", "harness", "sft-rl")  # sft-rl: skylift.demo_pipeline
# the tool prompt's solved problem (`skylift.data.tool_demo.TOOL_DEMO_EXAMPLES`) unless
# --worked-example says; the base model's start and the run's figures: benchmarks/RESULTS.md
TOOL_DEMO_WORKED_EXAMPLE = "sum"
TOOL_DEMO_EXAMPLE_CHOICES = ("product", "sum", "none")
DEMO_NUM_HELDOUT = 100  # held-out problems of either task


# Where bf16 matrix instructions exist (CUDA, x86 AVX512-BF16 / AMX, Arm BF16), the engine samples
# in bfloat16 and training runs bf16 matmuls over float32 weights: faster generation and logprobs
# than float32, at a larger rollout-trainer logprob gap (benchmarks/RESULTS.md). Elsewhere bf16 is
# emulated and slower, so the demo stays in float32.
BF16_OVERRIDES = ["generator.model_dtype=bfloat16", "trainer.bf16=true"]
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")


def has_fast_bf16(cpuinfo: str | None = None) -> bool:
    """True on CUDA or on a CPU whose flags list bf16 matrix instructions."""
    import torch

    if cpuinfo is None:
        if torch.cuda.is_available():
            return True
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return False
    flags: set[str] = set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            flags.update(value.split())
    return any(flag in flags for flag in BF16_CPU_FLAGS)


def demo_overrides(
    fast_bf16: bool | None = None, dynamic_sampling: bool = True, task: str = "addition"
) -> list[str]:
    """`DEMO_OVERRIDES` (and `TOOL_TASK_OVERRIDES` for `task` "tools") plus bf16 where it is fast
    (`has_fast_bf16`), leaving the KV cache to VLLM_CPU_KVCACHE_SPACE when the user set it.
    `dynamic_sampling=False` leaves out the demo's dynamic sampling (benchmarks that time one plain
    GRPO step, or fully async, which refuses it)."""
    if task not in DEMO_TASKS:
        raise ValueError(f"unknown demo task {task!r}; known: {', '.join(DEMO_TASKS)}")
    overrides = list(DEMO_OVERRIDES) + (TOOL_TASK_OVERRIDES if task in ("tools", "harness") else [])
    overrides += HARNESS_TASK_OVERRIDES if task == "harness" else []
    if not dynamic_sampling:
        overrides = [o for o in overrides if o not in DYNAMIC_SAMPLING_OVERRIDES]
    if fast_bf16 if fast_bf16 is not None else has_fast_bf16():
        overrides += BF16_OVERRIDES
    if os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        overrides = [o for o in overrides if not o.startswith("generator.kv_cache_gb=")]
    return overrides


class PeakMemory:
    """Peak memory of this process and all its descendants (vLLM engine core and worker, Ray).

    Samples every 0.5 s: the sum of PSS (proportional set size: a page shared by k processes
    counts 1/k in each, so shared libraries are not counted several times) and, for comparison,
    the sum of RSS.
    """

    def __init__(self) -> None:
        import psutil

        self._proc = psutil.Process()
        self.peak_pss = 0
        self.peak_rss = 0
        self.at_peak: dict[str, int] = {}  # PSS by process name when the sum peaked
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _sample(self) -> tuple[dict[str, int], int]:
        import psutil

        by_name: dict[str, int] = {}
        rss = 0
        for p in [self._proc, *self._proc.children(recursive=True)]:
            try:
                info = p.memory_full_info()
                name = "trainer" if p.pid == self._proc.pid else p.name()
            except psutil.Error:
                continue
            rss += info.rss
            by_name[name] = by_name.get(name, 0) + getattr(info, "pss", info.rss)
        return by_name, rss

    def _run(self) -> None:
        while not self._stop.is_set():
            by_name, rss = self._sample()
            pss = sum(by_name.values())
            if pss > self.peak_pss:
                self.peak_pss, self.at_peak = pss, by_name
            self.peak_rss = max(self.peak_rss, rss)
            self._stop.wait(0.5)

    def breakdown(self) -> str:
        """`name 1.23 GiB, ...` of the processes at the peak, largest first."""
        parts = sorted(self.at_peak.items(), key=lambda kv: -kv[1])
        return ", ".join(f"{name} {size / 2**30:.2f}" for name, size in parts)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def write_demo_data(task: str, data_dir: Path, worked_example: str | None = None) -> None:
    """The task's train and held-out prompts (`worked_example`: the tool prompt's solved problem)."""
    if task in ("tools", "harness"):
        from skylift.data.tool_demo import write_tool_demo

        write_tool_demo(
            data_dir, num_train=2000, num_val=DEMO_NUM_HELDOUT, seed=0, worked_example=worked_example
        )
    else:
        from skylift.data import write_addition_demo

        write_addition_demo(data_dir, num_train=2000, num_val=DEMO_NUM_HELDOUT, seed=0)


def run_demo(
    overrides: Sequence[str] = (),
    verbose: bool = False,
    task: str = "addition",
    worked_example: str | None = None,
) -> int:
    """`worked_example` (`task` "tools" only; None: `TOOL_DEMO_WORKED_EXAMPLE`): the solved problem
    the prompt holds as conversation turns, a name of `TOOL_DEMO_EXAMPLES` or "none" (without one
    SmolLM2 drew no tool call in 64 samples: benchmarks/RESULTS.md)."""
    from skylift.utils.quiet import quiet_libraries

    quiet_libraries(verbose)  # before vLLM and torch's C++ core print anything
    from skylift.cluster.run_paths import RunPaths
    from skylift.config import ConfigError, load_config
    from skylift.rl.build import build_trainer
    from skylift.rl.loop import RLTrainer
    from skylift.rl.run import run_trainer

    tools = task in ("tools", "harness")
    if worked_example is not None and not tools:
        print(
            "skylift demo: --worked-example / --no-worked-example go with --task tools or harness",
            file=sys.stderr,
        )
        return 2
    if task == "harness" and not HARNESS_AGENT.is_file():
        print(
            f"skylift demo: --task harness runs {HARNESS_AGENT}, not found (a source checkout has it)",
            file=sys.stderr,
        )
        return 2
    if tools and worked_example is None:
        worked_example = TOOL_DEMO_WORKED_EXAMPLE
    worked_example = None if worked_example == "none" else worked_example
    settings = demo_overrides(task=task)
    try:
        paths = RunPaths.from_config(load_config([*settings, *overrides]))
        data_dir = paths.root / "data"
        write_demo_data(task, data_dir, worked_example)
        cfg = load_config(
            [
                *settings,
                f"data.train_data=['{data_dir / 'train.parquet'}']",
                f"data.val_data=['{data_dir / 'validation.parquet'}']",
                *overrides,
            ]
        )
    except ConfigError as exc:
        print(f"skylift demo: configuration error: {exc}", file=sys.stderr)
        return 2
    training = "bf16 matmuls over float32 weights" if cfg.trainer.bf16 else "float32"
    precision = f"engine {cfg.generator.model_dtype}, training {training}"
    if BF16_OVERRIDES[0] not in settings:
        precision += " (no bf16 matrix instructions here: float32 by default)"
    print(f"[skylift demo] precision: {precision}", flush=True)
    if paths.logs.exists():  # a fresh curve for every demo run
        for old in paths.logs.glob("metrics.jsonl"):
            old.unlink()
    from skylift.utils.processes import exit_cleanly_on_sigterm

    exit_cleanly_on_sigterm()  # `kill PID` still shuts the engine down
    started = time.perf_counter()
    history: list[dict[str, float]] = []
    setup_s = train_s = 0.0

    def fit(trainer: RLTrainer) -> None:
        nonlocal setup_s, train_s
        setup_s = time.perf_counter() - started
        history.extend(trainer.fit())
        train_s = time.perf_counter() - started - setup_s

    with PeakMemory() as memory:
        code = run_trainer(lambda: build_trainer(cfg, verbose=verbose), fit, "skylift demo")
    if code:
        return code
    total_s = time.perf_counter() - started

    evals = [h for h in history if "eval/accuracy" in h]
    rewards = [h["reward/mean"] for h in history if "reward/mean" in h]
    before = evals[0] if evals and evals[0]["step"] == 0 else None
    after = evals[-1] if evals and evals[-1]["step"] > 0 else None
    first_rewards = rewards[: max(1, len(rewards) // 5)]
    last_rewards = rewards[-max(1, len(rewards) // 5) :]

    from skylift.tracking.plot import plot_run

    plot = plot_run(
        paths.logs, title=f"skylift demo '{cfg.trainer.run_name}': {cfg.trainer.policy.model.path}, GRPO"
    )
    print()
    print(f"{'':35}{'before':>11}   {'after':>11}")
    if before and after:
        print(f"held-out greedy accuracy (100)     {accuracy_cell(before):>11}   {accuracy_cell(after):>11}")
        if tools:
            print(f"held-out tool-call rate            {rate_cell(before):>11}   {rate_cell(after):>11}")
    if tools:
        calls = [h["env/used_tool"] if "env/used_tool" in h else 0.0 for h in history if "reward/mean" in h]
        if calls:
            first, last = calls[: max(1, len(calls) // 5)], calls[-max(1, len(calls) // 5) :]
            print(
                f"sampled tool-call rate (first/last) {statistics.fmean(first):10.0%}   "
                f"{statistics.fmean(last):11.0%}"
            )
    if rewards:
        print(
            f"mean sampled reward (first/last)   {statistics.fmean(first_rewards):11.3f}   "
            f"{statistics.fmean(last_rewards):11.3f}"
        )
    print()
    eval_s = sum(h.get("timing/eval_s", 0.0) for h in history)
    print(
        f"training steps: {len(rewards)}; training wall time {train_s:.0f} s "
        f"({train_s - eval_s:.0f} s without the {len(evals)} evaluations), "
        f"set-up {setup_s:.0f} s, total {total_s:.0f} s"
    )
    print(
        f"peak memory of all processes: {memory.peak_pss / 2**30:.2f} GiB PSS "
        f"({memory.peak_rss / 2**30:.2f} GiB summed RSS, shared pages counted once per process)"
    )
    print(f"  at the peak, GiB PSS by process: {memory.breakdown()}")
    print(f"plot: {plot}")
    print(f"metrics: {paths.logs / 'metrics.jsonl'}")
    return 0


def accuracy_cell(metrics: dict[str, float]) -> str:
    """An evaluation's accuracy with its standard error, e.g. ``'70% ± 4.6'`` (points). Where the
    environment reports whether each answer was right (``eval/env/correct``: the calculator, whose
    reward may include shaping), that share is the accuracy."""
    if "eval/env/correct" in metrics:
        share = metrics["eval/env/correct"]
        return format_accuracy(share, math.sqrt(share * (1 - share) / DEMO_NUM_HELDOUT))
    return format_accuracy(metrics["eval/accuracy"], metrics.get("eval/accuracy_stderr", 0.0))


def rate_cell(metrics: dict[str, float]) -> str:
    """The share of held-out problems where the model called the tool, e.g. ``'93%'``."""
    return f"{metrics.get('eval/env/used_tool', 0.0):.0%}"


def main(argv: Sequence[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="skylift demo")
    add_demo_arguments(parser)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    return run_demo(args.overrides, args.verbose, args.task, args.worked_example)


def add_demo_arguments(parser: Any) -> None:
    """`skylift demo`'s arguments (an `argparse` parser): overrides, --task, --worked-example, --verbose."""
    parser.add_argument(
        "overrides", nargs="*", metavar="key.sub=value", help="overrides of the demo's settings"
    )
    parser.add_argument(
        "--task",
        choices=DEMO_TASKS,
        default="addition",
        help="addition: two-digit sums; tools: products with a calculator tool (agentic RL, multi-turn); "
        "harness: the same task, the agent an openai-client program trained through the gateway; "
        "sft-rl: addition, supervised fine-tuning on worked examples then GRPO",
    )
    parser.add_argument(
        "--worked-example",
        choices=TOOL_DEMO_EXAMPLE_CHOICES,
        default=None,
        help=f"--task tools: the solved problem the prompt shows (default {TOOL_DEMO_WORKED_EXAMPLE}): "
        "sum (2 + 3: a call shown, not for a product; the base model starts near 3%%), "
        "product (23 * 456: it already calls the tool right on about half the problems)",
    )
    parser.add_argument(
        "--no-worked-example",
        dest="worked_example",
        action="store_const",
        const="none",
        help="--task tools: the prompt describes the tool without showing a solved problem",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="also print the libraries' own messages (vLLM, PyTorch, Ray, transformers)",
    )


if __name__ == "__main__":
    sys.exit(main())
