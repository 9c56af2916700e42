"""`skylift demo --task sft-rl`: the pipeline people run, supervised fine-tuning then GRPO.

SmolLM2-135M-Instruct on the addition demo's task (`skylift.data.synthetic`, the prompts of
`skylift demo`): first `skylift sft` on worked examples of the train problems (each train prompt
with a worked answer as the assistant's turn: the sum by place value, then the task's ``#### C``;
the held-out problems are never trained on), then GRPO from the SFT model with the addition demo's settings. One command;
the held-out greedy accuracy before, after SFT and after RL in one table, and one plot.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import pyarrow.parquet as pq

from skylift.demo import BF16_OVERRIDES, PeakMemory, accuracy_cell, demo_overrides, write_demo_data

SFT_EXAMPLES = 256  # worked train problems: 32 steps of 8
#: the share of the worked problems with a one-digit operand (about 19% of all pairs, 18 of the
#: 100 held-out): with the train file's natural share (39 of the first 256) the SFT model took a
#: one-digit operand for tens (``7 + 55: tens 70 + 50``) and got 13 of the 18 held-out ones wrong;
#: with half, it wrote a two-digit second operand's tens as 0 (``53 + 20: tens 50 + 0``); 0.3 with
#: SFT at 5e-5 (benchmarks/RESULTS.md, session 24)
ONE_DIGIT_SHARE: float | None = 0.3
SFT_OVERRIDES = [
    "model.path=smollm2-135m-instruct",
    "batch_size=8",
    "micro_train_batch_size_per_gpu=8",
    "num_steps=32",
    "optimizer_config.lr=5e-5",
    "optimizer_config.scheduler=cosine",
    "optimizer_config.num_warmup_steps=2",
    "optimizer_config.weight_decay=0.0",
    "placement.backend=local",
    "run_name=demo-sft-rl-sft",
    "train_on_what=last_assistant_message",  # the answer, not the prompt's worked example again
]
RL_STEPS = 14  # SFT + GRPO within 8 minutes of training on 2 cores (benchmarks/RESULTS.md)
#: the GRPO stage's rollout budget: the worked answers SFT teaches are 41-51 tokens (with the end
#: of turn), more than the addition demo's 40 for its direct answers; a rollout cut before its
#: ``#### C`` line scores 0, so with 40 GRPO learned from truncated rollouts only
RL_MAX_GENERATE_LENGTH = 64


def worked_answer(a: int, b: int) -> str:
    """A + B worked out by place value, then the task's ``#### C`` line, e.g. ``"27 + 45: tens
    20 + 40 = 60, units 7 + 5 = 12, 60 + 12 = 72\\n#### 72"``."""
    tens, units = (a // 10 + b // 10) * 10, a % 10 + b % 10
    return (
        f"{a} + {b}: tens {a // 10 * 10} + {b // 10 * 10} = {tens}, units {a % 10} + {b % 10} = {units}, "
        f"{tens} + {units} = {a + b}\n#### {a + b}"
    )


def write_sft_examples(
    train_parquet: Path,
    out: Path,
    limit: int = SFT_EXAMPLES,
    one_digit_share: float | None = ONE_DIGIT_SHARE,
) -> Path:
    """`limit` train prompts with their worked answers (`worked_answer`) as chat rows: the first
    ``round(limit * one_digit_share)`` of the train file with a one-digit operand and the first of
    the rest, in the file's order (`one_digit_share` None: the file's first `limit`)."""
    one_digit = limit if one_digit_share is None else round(limit * one_digit_share)
    quota = {True: one_digit, False: limit if one_digit_share is None else limit - one_digit}
    rows = []
    for row in pq.read_table(train_parquet).to_pylist():
        kind = min(int(row["extra_info"]["a"]), int(row["extra_info"]["b"])) < 10
        if quota[kind] > 0 and len(rows) < limit:
            quota[kind] -= 1
            rows.append(row)
    if len(rows) < limit:
        raise ValueError(f"{train_parquet} has too few train problems for {limit} worked examples")
    with out.open("w") as f:
        for row in rows:
            answer = worked_answer(int(row["extra_info"]["a"]), int(row["extra_info"]["b"]))
            f.write(
                json.dumps({"messages": [*row["prompt"], {"role": "assistant", "content": answer}]}) + "\n"
            )
    return out


def run_pipeline_demo(overrides: Sequence[str] = (), verbose: bool = False) -> int:
    """SFT then GRPO (see the module docstring); `overrides` apply to the GRPO stage."""
    from skylift.utils.quiet import quiet_libraries

    quiet_libraries(verbose)
    from skylift.cluster.run_paths import RunPaths
    from skylift.config import ConfigError, load_config
    from skylift.config.sft import load_sft_config
    from skylift.rl.build import build_trainer
    from skylift.rl.eval_only import EvalOnlyRun
    from skylift.rl.loop import RLTrainer
    from skylift.rl.run import run_trainer
    from skylift.supervised.trainer import SupervisedTrainer
    from skylift.tracking.plot import plot_run

    settings = [
        *demo_overrides(task="addition"),
        "trainer.run_name=demo-sft-rl",
        f"trainer.max_steps={RL_STEPS}",
        f"generator.max_generate_length={RL_MAX_GENERATE_LENGTH}",
    ]
    bf16 = BF16_OVERRIDES[1] in settings
    try:
        paths = RunPaths.from_config(load_config([*settings, *overrides]))
        data = paths.root / "data"
        write_demo_data("addition", data)
        examples = write_sft_examples(data / "train.parquet", data / "sft.jsonl")
        files = [
            f"data.train_data=['{data / 'train.parquet'}']",
            f"data.val_data=['{data / 'validation.parquet'}']",
        ]
        base_cfg = load_config([*settings, *files, *overrides])
        sft_cfg = load_sft_config(
            [*SFT_OVERRIDES, f"train_datasets=[{examples}]", f"runs_dir={paths.root / 'sft'}", f"bf16={bf16}"]
            + [f"seed={base_cfg.trainer.seed}"]  # trainer.seed=N: the SFT stage's data order too
        )
    except ConfigError as exc:
        print(f"skylift demo: configuration error: {exc}", file=sys.stderr)
        return 2
    for old in paths.logs.glob("metrics.jsonl"):
        old.unlink()
    say = _say
    started = time.perf_counter()
    base: dict[str, float] = {}

    def eval_base(run: EvalOnlyRun) -> None:
        base.update(run.evaluate())

    say(f"1/3 held-out accuracy of {base_cfg.trainer.policy.model.path} before any training")
    eval_cfg = load_config([*settings, *files, *overrides, f"trainer.log_dir={paths.root / 'base_eval'}"])
    with PeakMemory() as memory:
        code = run_trainer(lambda: EvalOnlyRun(eval_cfg, say, verbose), eval_base, "skylift demo")
        if code:
            return code
        say(f"2/3 supervised fine-tuning on {SFT_EXAMPLES} worked train problems ({examples})")
        sft_started = time.perf_counter()
        with SupervisedTrainer(sft_cfg, say=say) as sft:
            losses = sft.run()
            model = sft.paths.export / f"global_step_{len(losses)}"
        sft_s = time.perf_counter() - sft_started
        say(f"3/3 GRPO from the SFT model ({model})")
        rl_cfg = load_config([*settings, *files, f"trainer.policy.model.path={model}", *overrides])
        history: list[dict[str, float]] = []
        rl_s = 0.0

        def fit(trainer: RLTrainer) -> None:
            nonlocal rl_s
            tick = time.perf_counter()
            history.extend(trainer.fit())
            rl_s = time.perf_counter() - tick

        code = run_trainer(lambda: build_trainer(rl_cfg, verbose=verbose), fit, "skylift demo")
        if code:
            return code
    evals = [h for h in history if "eval/accuracy" in h]
    rl_eval_s = sum(h.get("timing/eval_s", 0.0) for h in history)
    plot = plot_run(
        paths.logs, title=f"skylift demo 'sft-rl': SmolLM2-135M, SFT ({len(losses)} steps) then GRPO"
    )
    print()
    print(f"{'':33}{'before':>11}   {'after SFT':>11}   {'after RL':>11}")
    if base and evals:
        print(
            f"held-out greedy accuracy (100)   {accuracy_cell(base):>11}   {accuracy_cell(evals[0]):>11}   "
            f"{accuracy_cell(evals[-1]):>11}"
        )
    print(f"SFT loss (first/last step)       {'':>11}   {losses[0]:>5.3f} -> {losses[-1]:.3f}")
    print()
    print(
        f"training: SFT {sft_s:.0f} s ({len(losses)} steps) + GRPO {rl_s - rl_eval_s:.0f} s "
        f"({rl_cfg.trainer.max_steps} steps, without its {len(evals)} evaluations) = {sft_s + rl_s - rl_eval_s:.0f} s; "
        f"whole command {time.perf_counter() - started:.0f} s"
    )
    print(f"peak memory of all processes: {memory.peak_pss / 2**30:.2f} GiB PSS")
    print(f"plot: {plot}")
    return 0


def _say(line: str) -> None:
    print(f"[skylift demo] {line}", flush=True)


__all__ = ["RL_MAX_GENERATE_LENGTH", "run_pipeline_demo", "worked_answer", "write_sft_examples"]
