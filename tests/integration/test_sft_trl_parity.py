"""`skylift sft` equals TRL's `SFTTrainer` step by step on the same model, data and settings.

Same tiny model (tiny-qwen2, fp32), the same chat rows in the same order, the same optimizer
(AdamW, constant lr, clip 1.0) and batches (4 rows a step as 2 micro-batches of 2): skylift's
per-step loss equals TRL 1.16's within 1e-4 over 20 steps, padded and padding-free (TRL's
``padding_free=True`` flattens each micro-batch into one row as skylift's
``remove_microbatch_padding`` does). TRL marks the assistant's tokens with
``return_assistant_tokens_mask`` over a copy of the template with ``{% generation %}`` tags; skylift
reads them off the untagged template (`skylift.supervised.tokens`): the ids and masks are equal.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from trl_parity import recording, trl_args

from skylift.config.sft import load_sft_config
from skylift.supervised.trainer import SupervisedTrainer

trl = pytest.importorskip("trl")

STEPS = 20
# the tiny model's ChatML template with the assistant's turn (content, <|im_end|>, newline) tagged
TAGGED_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{{- '<|im_start|>assistant\\n' -}}{%- generation -%}"
    "{{- message['content'] + '<|im_end|>' + '\\n' -}}{%- endgeneration -%}"
    "{%- else -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def chat_rows(n: int = 40, seed: int = 0) -> list[dict]:
    """Conversations of mixed lengths: one or two assistant turns, a system prompt on some."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        messages = [{"role": "system", "content": "You add numbers."}] if i % 4 == 0 else []
        messages += [
            {"role": "user", "content": f"What is {a} + {b}?"},
            {"role": "assistant", "content": f"{a} + {b} = {a + b}. " + "Done. " * rng.randrange(4)},
        ]
        if i % 3 == 0:
            messages += [
                {"role": "user", "content": "And twice that?"},
                {"role": "assistant", "content": f"{2 * (a + b)}"},
            ]
        rows.append({"messages": messages})
    return rows


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def skylift_losses(
    model: Path, data: Path, tmp: Path, packed: bool, extra: tuple[str, ...] = ()
) -> list[float]:
    cfg = load_sft_config(
        [
            f"model.path={model}",
            f"train_datasets=[{data}]",
            "shuffle=false",
            "batch_size=4",
            "micro_train_batch_size_per_gpu=2",
            f"num_steps={STEPS}",
            "optimizer_config.lr=1e-3",
            "optimizer_config.weight_decay=0.0",
            "optimizer_config.scheduler=constant",
            "optimizer_config.max_grad_norm=1.0",
            f"remove_microbatch_padding={str(packed).lower()}",
            "placement.backend=local",
            f"runs_dir={tmp}",
            *extra,
        ]
    )
    with SupervisedTrainer(cfg, say=lambda _: None) as trainer:
        return trainer.run()


def trl_losses(model: Path, rows: list[dict], tmp: Path, packed: bool) -> tuple[list[float], object]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = TAGGED_TEMPLATE
    recorded: list[float] = []

    Recording = recording(SFTTrainer, recorded)

    args = trl_args(
        SFTConfig,
        str(tmp / "trl"),
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=STEPS,
        assistant_only_loss=True,
        padding_free=packed,
        max_length=None,
    )
    trainer = Recording(
        model=str(model), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    trainer.train()
    per_step = [recorded[i] + recorded[i + 1] for i in range(0, len(recorded), 2)]
    return per_step, trainer


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_sft_loss_per_step_equals_trl(tiny_model_dir: Path, tmp_path: Path, packed: bool) -> None:
    rows = chat_rows()
    data = write_jsonl(rows, tmp_path / "chats.jsonl")
    ours = skylift_losses(tiny_model_dir, data, tmp_path / "runs", packed)
    theirs, trainer = trl_losses(tiny_model_dir, rows, tmp_path, packed)
    assert len(ours) == len(theirs) == STEPS
    worst = max(abs(a - b) for a, b in zip(ours, theirs, strict=True))
    assert worst < 1e-4, f"skylift {ours}\nTRL     {theirs}"
    assert ours[-1] < ours[0] - 0.5  # it learned something: the comparison is not of constants
