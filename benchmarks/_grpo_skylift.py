"""The skylift side of `grpo_step_vs_trl.py`: `RLTrainer` with the demo's float32 settings on the
benchmark's batch; the last step of `fit()` is the timed one.

Benchmarks run as `python benchmarks/NAME.py`, so this module is importable as `_grpo_skylift`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from _grpo_common import MODEL, StepProbe


def write_data(out_dir: Path, num_prompts: int) -> Path:
    """Write the demo's parquet files with `num_prompts` train prompts; returns train.parquet."""
    from skylift.data import write_addition_demo

    write_addition_demo(out_dir, num_train=num_prompts, num_val=8, seed=0)
    return out_dir / "train.parquet"


def skylift_overrides(args: argparse.Namespace, work: Path, every_row: bool) -> list[str]:
    """skylift's config overrides for the benchmark's batch (the demo's float32 settings).
    `every_row`: train the rows whose advantages are all zero too (not skipped)."""
    from skylift.demo import demo_overrides

    train_file = write_data(work / "data", args.num_prompts)
    return [
        *demo_overrides(fast_bf16=False, dynamic_sampling=False),  # float32 and one round, as TRL
        f"trainer.policy.model.path={MODEL}",
        "trainer.run_name=bench_grpo_step_vs_trl",
        f"trainer.log_dir={work / 'skylift_logs'}",
        f"trainer.ckpt_path={work / 'skylift_ckpts'}",
        f"trainer.export_path={work / 'skylift_exports'}",
        f"data.train_data=['{train_file}']",
        f"data.val_data=['{work / 'data' / 'validation.parquet'}']",
        "trainer.algorithm.advantage_estimator=grpo",
        "trainer.algorithm.use_kl_loss=false",
        "trainer.algorithm.use_kl_in_reward=false",
        "trainer.algorithm.loss_reduction=token_mean",
        f"trainer.train_batch_size={args.num_prompts}",
        f"trainer.policy_mini_batch_size={args.num_prompts}",
        f"generator.n_samples_per_prompt={args.group_size}",
        f"generator.max_generate_length={args.max_new_tokens}",
        "generator.sampling_params.temperature=1.0",
        "generator.zero_reward_on_non_stop=false",
        f"trainer.policy.optimizer_config.lr={args.lr}",
        f"trainer.gradient_checkpointing={str(args.skylift_gradient_checkpointing).lower()}",
        "trainer.bf16=false",
        f"trainer.max_steps={args.warmup_steps + 1}",
        f"trainer.epochs={args.warmup_steps + 1}",  # every step trains on the same prompts
        "trainer.eval_before_train=false",
        "trainer.eval_interval=-1",
        "trainer.ckpt_interval=-1",
        "trainer.hf_save_interval=-1",
        "trainer.resume_mode=none",
        f"trainer.seed={args.seed}",
        *args.skylift_override,
        *(["trainer.skip_zero_advantage_rows=false"] if every_row else []),
    ]


def run_skylift(args: argparse.Namespace, work: Path, every_row: bool) -> dict[str, Any]:
    """Set up skylift's trainer, run `args.warmup_steps` + 1 GRPO steps, return the timings and
    completions of the last one (and the earlier steps' times and completions).
    `every_row`: train the rows whose advantages are all zero too (not skipped)."""
    from skylift.config import load_config
    from skylift.generator import Trajectory
    from skylift.rl.build import build_trainer

    cfg = load_config(skylift_overrides(args, work, every_row))
    tick = time.perf_counter()
    trainer = build_trainer(cfg)
    recorded: dict[int, list[Trajectory]] = {}  # training step (0-based) -> its completions
    sampler = trainer.source.sampler  # type: ignore[attr-defined]  # the training rollouts'
    original_run = sampler.run
    original_step = trainer.step
    probe = StepProbe()

    def recording_run(rows: list[Any], step: int) -> list[Trajectory]:
        out = original_run(rows, step)
        recorded.setdefault(step, []).extend(out)
        return out

    def probed_step() -> dict[str, float]:
        probe.mark()
        try:
            return original_step()
        finally:
            probe.mark()

    sampler.run = recording_run
    trainer.step = probed_step  # type: ignore[method-assign]
    try:
        trainer.setup()
        setup_s = time.perf_counter() - tick
        tick = time.perf_counter()
        history = trainer.fit()
        fit_s = time.perf_counter() - tick
    finally:
        trainer.shutdown()
    steps = [h for h in history if "timing/step_s" in h]
    expected = args.warmup_steps + 1
    if len(steps) != expected or sorted(recorded) != list(range(expected)):
        raise RuntimeError(f"expected {expected} training steps from fit(), got {len(steps)}: {history}")
    batch = args.num_prompts * args.group_size
    for step, trajectories in recorded.items():
        if len(trajectories) != batch:
            raise RuntimeError(
                f"skylift generated {len(trajectories)} completions at step {step + 1}, expected {batch}"
            )
    metrics = steps[-1]

    def completions(trajectories: list[Trajectory]) -> list[dict[str, Any]]:
        return [
            {
                "uid": tr.uid,
                "text": tr.response_text,
                "ground_truth": str(tr.env_metadata.get("ground_truth")),
                "reward": tr.reward,
            }
            for tr in trajectories
        ]

    return {
        "setup_s": setup_s,
        "step_s": metrics["timing/step_s"],
        "warmup_step_s": [h["timing/step_s"] for h in steps[:-1]],
        "warmup_phases": [_timing_phases(h) for h in steps[:-1]],
        "fit_s": fit_s,
        **probe.summary(),
        "phases": _timing_phases(metrics),
        "reward_mean": metrics["reward/mean"],
        "rows_trained_frac": metrics.get("train/rows_trained_frac", 1.0),
        "response_length_mean": metrics["response_length/mean"],
        "response_length_max": metrics["response_length/max"],
        "gradient_checkpointing": args.skylift_gradient_checkpointing,
        "completions": completions(recorded[args.warmup_steps]),
        "warmup_completions": [c for step in range(args.warmup_steps) for c in completions(recorded[step])],
    }


def _timing_phases(metrics: dict[str, float]) -> dict[str, float]:
    return {k.removeprefix("timing/"): v for k, v in metrics.items() if k.startswith("timing/")}
