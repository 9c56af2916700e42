"""Supervised fine-tuning throughput: `skylift sft` against TRL's `SFTTrainer`, side by side.

Both sides train SmolLM2-135M-Instruct (fp32, `skylift.models`) on the same 64 chat rows of mixed
lengths (a user question, an assistant answer of 8 to ~300 tokens), in the same order, 8 rows a
step as 2 micro-batches of 4, AdamW at a constant 2e-5, the loss on the assistant's tokens. Each
side first takes `--warmup-steps` (1) untimed steps; the timed steps follow (`--steps`, 4). The
two sides' steps alternate (skylift's step k runs, untimed by TRL, right after TRL's step k), so
that a shared machine's varying load falls on both alike rather than on one side's whole run.

- skylift: `SupervisedTrainer` in this process (one rank, no Ray), its defaults: padding-free
  micro-batches (`remove_microbatch_padding=true`); a step is `train_step`'s wall time.
- TRL 1.16: `SFTTrainer` with `assistant_only_loss=True` over a ``{% generation %}``-tagged copy of
  the model's template, its defaults otherwise (padded micro-batches), `bf16=False`, `use_cpu=True`,
  gradient checkpointing off as on skylift's side; a step is the time from the `on_step_begin` to
  the `on_step_end` callback.

The ratio is skylift's time over TRL's for the same timed steps (the same tokens), so below 1 is
skylift faster: ``ratio`` of the process CPU time of the steps (on a shared machine the wall time
depends on what else runs), ``ratio_wall`` of their wall time. The loss of the last step must
agree within 2%. The last line is one JSON object.

    python benchmarks/sft_vs_trl.py            # (--model tiny-qwen2 for a quick check)
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

WORDS = "the model adds two numbers and writes each step of the sum before the final answer".split()
SMOLLM_TAGGED = (  # SmolLM2-Instruct's template with the assistant's turn tagged
    "{%- for message in messages -%}"
    "{%- if loop.first and messages[0]['role'] != 'system' -%}"
    "{{- '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- if message['role'] == 'assistant' -%}{{- '<|im_start|>assistant\\n' -}}{%- generation -%}"
    "{{- message['content'] + '<|im_end|>' + '\\n' -}}{%- endgeneration -%}"
    "{%- else -%}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_rows(n: int = 64, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(1000), rng.randrange(1000)
        words = rng.choice([8, 16, 32, 64, 128, 256])
        answer = " ".join(rng.choice(WORDS) for _ in range(words)) + f". {a} + {b} = {a + b}"
        messages = [{"role": "system", "content": "You are a careful assistant."}] if i % 2 else []
        messages += [
            {"role": "user", "content": f"Explain {a} + {b}."},
            {"role": "assistant", "content": answer},
        ]
        rows.append({"messages": messages})
    return rows


class SkyliftSteps:
    """`SupervisedTrainer` in this process (its defaults), stepped from TRL's step callback."""

    def __init__(self, model: str, data: Path, runs: Path, steps: int, warmup: int) -> None:
        from skylift.config.sft import load_sft_config
        from skylift.supervised.trainer import SupervisedTrainer

        cfg = load_sft_config(
            [
                f"model.path={model}",
                f"train_datasets=[{data}]",
                "shuffle=false",
                "batch_size=8",
                "micro_train_batch_size_per_gpu=4",
                f"num_steps={steps + warmup}",
                "optimizer_config.lr=2e-5",
                "optimizer_config.weight_decay=0.0",
                "optimizer_config.scheduler=constant",
                "placement.backend=local",
                f"runs_dir={runs}",
            ]
        )
        self.warmup = warmup
        self.losses: list[float] = []
        self.times: list[float] = []
        self.cpu: list[float] = []
        self.tokens = 0
        self.trainer = SupervisedTrainer(cfg, say=lambda _: None)
        self.trainer.start()

    def step(self, step: int) -> None:
        rows = self.trainer.batches.rows(step)
        started = time.process_time()
        m = self.trainer.train_step(rows)
        self.losses.append(m["loss"])
        if step >= self.warmup:
            self.times.append(m["step_s"])
            self.cpu.append(time.process_time() - started)
            self.tokens += sum(len(r.ids) for r in rows)

    def close(self) -> None:
        self.trainer.close()


def run_trl(
    model: str, rows: list[dict], out: Path, steps: int, warmup: int, between: Callable[[int], None]
) -> tuple[list[float], list[float], list[float]]:
    """TRL's losses, step times and CPU times; `between(step)` runs after each step, untimed."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    from skylift.models import resolve_model_path

    path = str(resolve_model_path(model))
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = SMOLLM_TAGGED
    recorded: list[float] = []
    times: list[float] = []
    cpu: list[float] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            self.t, self.c = time.perf_counter(), time.process_time()

        def on_step_end(self, args, state, control, **kw):  # noqa: ANN001, ANN003
            times.append(time.perf_counter() - self.t)
            cpu.append(time.process_time() - self.c)
            between(state.global_step - 1)

    class Recording(SFTTrainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):  # noqa: ANN001
            result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            recorded.append(float((result[0] if isinstance(result, tuple) else result).detach()))
            return result

    args = SFTConfig(
        output_dir=str(out),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        max_steps=steps + warmup,
        learning_rate=2e-5,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        assistant_only_loss=True,
        max_length=None,
        train_sampling_strategy="sequential",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        logging_strategy="no",
        model_init_kwargs={"dtype": torch.float32},
    )
    trainer = Recording(
        model=path,
        args=args,
        train_dataset=Dataset.from_list(rows),
        processing_class=tok,
        callbacks=[Timer()],
    )
    trainer.train()
    losses = [recorded[i] + recorded[i + 1] for i in range(0, len(recorded), 2)]
    return losses, times[warmup:], cpu[warmup:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup-steps", type=int, default=1)
    args = parser.parse_args()
    from skylift.utils.quiet import quiet_libraries

    quiet_libraries(False)
    rows = chat_rows()
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "chats.jsonl"
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        sky = SkyliftSteps(args.model, data, Path(tmp) / "runs", args.steps, args.warmup_steps)
        try:
            theirs, their_times, their_cpu = run_trl(
                args.model, rows, Path(tmp) / "trl", args.steps, args.warmup_steps, sky.step
            )
        finally:
            sky.close()
        ours, our_times, our_cpu, tokens = sky.losses, sky.times, sky.cpu, sky.tokens
    ours_s, theirs_s = sum(our_times), sum(their_times)
    ours_cpu, theirs_cpu = sum(our_cpu), sum(their_cpu)
    gap = abs(ours[-1] - theirs[-1]) / abs(theirs[-1])
    print(f"timed steps: {args.steps} of 8 rows ({tokens} tokens), after {args.warmup_steps} warm-up step(s)")
    for name, wall, cpu, steps in (
        ("skylift sft", ours_s, ours_cpu, our_times),
        ("TRL SFTTrainer", theirs_s, theirs_cpu, their_times),
    ):
        print(
            f"{name}: {wall:.1f} s wall ({tokens / wall:.0f} tok/s), {cpu:.1f} s CPU "
            f"({tokens / cpu:.0f} tok/CPU-s); steps {[round(t, 2) for t in steps]}"
        )
    print(f"loss per step, skylift: {[round(x, 4) for x in ours]}")
    print(f"loss per step, TRL:     {[round(x, 4) for x in theirs]}")
    print(f"last-step loss gap {gap:.2%} (goal < 2%)")
    print(
        json.dumps(
            {
                "ratio": round(ours_cpu / theirs_cpu, 3),
                "ratio_wall": round(ours_s / theirs_s, 3),
                "skylift_cpu_s": round(ours_cpu, 2),
                "trl_cpu_s": round(theirs_cpu, 2),
                "skylift_s": round(ours_s, 2),
                "trl_s": round(theirs_s, 2),
                "tokens": tokens,
                "last_loss_skylift": round(ours[-1], 5),
                "last_loss_trl": round(theirs[-1], 5),
                "loss_gap": round(gap, 5),
                "model": args.model,
            }
        )
    )


if __name__ == "__main__":
    main()
