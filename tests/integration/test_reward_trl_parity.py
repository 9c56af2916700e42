"""`skylift sft objective=reward` equals TRL's `RewardTrainer` step by step: the same tiny model
(fp32, the new head initialised from the same seed), pairs, order, optimizer (AdamW, constant lr,
clip 1.0); 4 pairs a step. Every step's loss equals TRL 1.16's within 1e-4 over 6 steps, for
conversational pairs with a margin column and for plain-text pairs."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from trl_parity import recording, trl_args

from skylift.config.sft import load_sft_config
from skylift.supervised.reward import RewardModelTrainer

trl = pytest.importorskip("trl")
STEPS = 6


def pairs(kind: str, n: int = 24, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        good, bad = f"{a} + {b} = {a + b}" + " ok" * (i % 3), f"It is {wrong}."
        if kind == "plain":
            rows.append({"prompt": f"What is {a} + {b}? ", "chosen": good, "rejected": bad})
        else:
            rows.append(
                {
                    "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                    "chosen": [{"role": "assistant", "content": good}],
                    "rejected": [{"role": "assistant", "content": bad}],
                    "margin": 0.25 * (i % 4),
                }
            )
    return rows


def ours(model: Path, data: Path, runs: Path) -> list[float]:
    cfg = load_sft_config(
        [
            f"model.path={model}",
            f"train_datasets=[{data}]",
            "objective=reward",
            "shuffle=false",
            "batch_size=4",
            "micro_train_batch_size_per_gpu=3",
            f"num_steps={STEPS}",
            "optimizer_config.lr=1e-3",
            "optimizer_config.weight_decay=0.0",
            "optimizer_config.scheduler=constant",
            "optimizer_config.max_grad_norm=1.0",
            "placement.backend=local",
            f"runs_dir={runs}",
        ]
    )
    with RewardModelTrainer(cfg, say=lambda _: None) as trainer:
        return trainer.run()


def theirs(model: Path, rows: list[dict], tmp: Path) -> list[float]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    recorded: list[float] = []

    Recording = recording(RewardTrainer, recorded)

    args = trl_args(
        RewardConfig,
        str(tmp / "trl"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
    )
    tok = AutoTokenizer.from_pretrained(model)
    trainer = Recording(
        model=str(model), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    trainer.train()
    return recorded


@pytest.mark.parametrize("kind", ["conversational_margin", "plain"])
def test_reward_loss_per_step_equals_trl(tiny_model_dir: Path, tmp_path: Path, kind: str) -> None:
    rows = pairs(kind)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    skylift = ours(tiny_model_dir, data, tmp_path / "runs")
    trl_losses = theirs(tiny_model_dir, rows, tmp_path)
    assert len(skylift) == len(trl_losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(skylift, trl_losses, strict=True))
    assert worst < 1e-4, f"skylift {skylift}\nTRL     {trl_losses}"
    assert skylift[-1] < skylift[0]
