"""The TRL side of `grpo_step_vs_trl.py`: TRL's `GRPOTrainer` on the benchmark's batch, each
step timed by phase through Trainer callbacks and wrapped methods.

Benchmarks run as `python benchmarks/NAME.py`, so this module is importable as `_grpo_trl`.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from _grpo_common import MODEL, StepProbe, hash_answer_reward, train_rows


class _PhaseTimer:
    """Accumulates wall time per named phase; wraps bound methods of an object in place."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.open: dict[str, float] = {}

    def wrap(self, obj: Any, method: str, phase: str) -> None:
        original = getattr(obj, method)

        def timed(*a: Any, **kw: Any) -> Any:
            tick = time.perf_counter()
            try:
                return original(*a, **kw)
            finally:
                self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - tick

        setattr(obj, method, timed)

    def begin(self, phase: str) -> None:
        self.open[phase] = time.perf_counter()

    def end(self, phase: str) -> None:
        self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - self.open.pop(phase)


def run_trl(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """Build TRL's GRPOTrainer, run `args.warmup_steps` + 1 steps, return the timings and
    completions of the last one (and the earlier steps' times and completions)."""
    import torch
    import trl
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from skylift.models import prepare_model

    if args.trl_threads:
        torch.set_num_threads(args.trl_threads)
    model_dir = prepare_model(MODEL)
    rows = train_rows(args.num_prompts)
    dataset = Dataset.from_list(
        [{"prompt": r["prompt"], "ground_truth": r["reward_spec"]["ground_truth"]} for r in rows]
    )
    recorded: dict[int, list[dict[str, Any]]] = {}  # training step (0-based) -> its completions
    timer = _PhaseTimer()
    probe = StepProbe()
    steps_seconds: list[dict[str, float]] = []  # phase seconds of each step

    def recording_reward(
        prompts: list[Any], completions: list[Any], ground_truth: list[str], **kwargs: Any
    ) -> list[float]:
        rewards = hash_answer_reward(completions, ground_truth)
        for prompt, completion, truth, reward in zip(
            prompts, completions, ground_truth, rewards, strict=True
        ):
            text = completion if isinstance(completion, str) else completion[-1]["content"]
            question = prompt if isinstance(prompt, str) else prompt[-1]["content"]
            recorded.setdefault(len(steps_seconds), []).append(
                {"uid": question, "text": text, "ground_truth": truth, "reward": reward}
            )
        return rewards

    recording_reward.__name__ = "hash_answer_reward"

    class StepClock(TrainerCallback):
        """Times each optimizer step and whole training step through Trainer callbacks; the
        probe (CPU seconds, load) watches the timed one (after `args.warmup_steps`)."""

        def on_step_begin(self, *a: Any, **kw: Any) -> None:
            timer.seconds = {}
            probe.mark()
            timer.begin("step")

        def on_pre_optimizer_step(self, *a: Any, **kw: Any) -> None:
            timer.begin("optimizer")

        def on_optimizer_step(self, *a: Any, **kw: Any) -> None:
            timer.end("optimizer")

        def on_step_end(self, *a: Any, **kw: Any) -> None:
            timer.end("step")
            steps_seconds.append(dict(timer.seconds))
            probe.mark()

    batch = args.num_prompts * args.group_size
    if batch % args.trl_micro_batch:
        raise ValueError(f"--trl-micro-batch {args.trl_micro_batch} must divide {batch} completions")
    config = GRPOConfig(
        output_dir=str(work / "trl_out"),
        per_device_train_batch_size=args.trl_micro_batch,
        gradient_accumulation_steps=batch // args.trl_micro_batch,
        num_generations=args.group_size,
        max_completion_length=args.max_new_tokens,
        temperature=1.0,
        top_p=1.0,
        learning_rate=args.lr,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        beta=0.0,
        loss_type="dapo",  # token mean over the batch, as skylift's token_mean
        scale_rewards="group",
        num_iterations=1,
        max_steps=args.warmup_steps + 1,
        num_train_epochs=args.warmup_steps + 1,  # every step trains on the same prompts
        gradient_checkpointing=True,
        bf16=False,
        fp16=False,
        use_cpu=True,
        model_init_kwargs={"dtype": torch.float32},
        report_to=[],
        logging_steps=1,
        save_strategy="no",
        seed=args.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    tick = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    clock = StepClock()
    trainer = GRPOTrainer(
        model=str(model_dir),
        reward_funcs=[recording_reward],
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[clock],
    )
    setup_s = time.perf_counter() - tick
    timer.wrap(trainer, "_generate_and_score_completions", "rollout")
    timer.wrap(trainer, "_generate", "generate")
    timer.wrap(trainer, "_calculate_rewards", "rewards")
    timer.wrap(trainer, "_prepare_inputs", "prepare_inputs")
    timer.wrap(trainer, "compute_loss", "forward_loss")
    timer.wrap(trainer, "training_step", "training_step")
    tick = time.perf_counter()
    result = trainer.train()
    train_s = time.perf_counter() - tick
    expected = args.warmup_steps + 1
    if trainer.state.global_step != expected or len(steps_seconds) != expected:
        raise RuntimeError(f"TRL ran {trainer.state.global_step} optimizer steps, expected {expected}")
    for step in range(expected):
        if len(recorded.get(step, [])) != batch:
            raise RuntimeError(
                f"TRL's reward function saw {len(recorded.get(step, []))} completions at step "
                f"{step + 1}, expected {batch}"
            )

    def phases(s: dict[str, float]) -> dict[str, float]:
        return {
            "generate_s": s.get("generate", 0.0),
            "rewards_s": s.get("rewards", 0.0),
            "rollout_other_s": s.get("rollout", 0.0) - s.get("generate", 0.0) - s.get("rewards", 0.0),
            "forward_loss_s": s.get("forward_loss", 0.0),
            "backward_s": s.get("training_step", 0.0)
            - s.get("prepare_inputs", 0.0)
            - s.get("forward_loss", 0.0),
            "optimizer_s": s.get("optimizer", 0.0),
            "step_s": s["step"],
        }

    timed = recorded[args.warmup_steps]
    lengths = [len(tokenizer(c["text"], add_special_tokens=False)["input_ids"]) for c in timed]
    rewards = [c["reward"] for c in timed]
    return {
        "trl_version": trl.__version__,
        "torch_threads": torch.get_num_threads(),
        "setup_s": setup_s,
        "step_s": steps_seconds[-1]["step"],
        "warmup_step_s": [s["step"] for s in steps_seconds[:-1]],
        "warmup_phases": [phases(s) for s in steps_seconds[:-1]],
        "train_s": train_s,
        **probe.summary(),
        "phases": phases(steps_seconds[-1]),
        "loss": float(result.training_loss),
        "reward_mean": sum(rewards) / len(rewards),
        "response_length_mean": sum(lengths) / len(lengths),
        "response_length_max": max(lengths),
        "completions": timed,
        "warmup_completions": [c for step in range(args.warmup_steps) for c in recorded[step]],
    }
