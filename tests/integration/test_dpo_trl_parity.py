"""`skylift sft objective=dpo` equals TRL's `DPOTrainer` step by step: the same tiny model (fp32),
pairs, order, optimizer (AdamW, constant lr, clip 1.0) and beta; 4 pairs a step. The loss of step
0 is ln 2 (the policy is the reference) and every step's loss equals TRL 1.16's within 1e-4 over
10 steps, for the sigmoid (DPO) and IPO losses."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
from trl_parity import recording, trl_args

from skylift.config.sft import load_sft_config
from skylift.supervised.dpo import PreferenceTrainer

trl = pytest.importorskip("trl")
STEPS = 10


def pairs(n: int = 40, seed: int = 1) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        a, b = rng.randrange(100), rng.randrange(100)
        wrong = a + b + rng.choice([-10, -1, 1, 10])
        rows.append(
            {
                "prompt": [{"role": "user", "content": f"What is {a} + {b}?"}],
                "chosen": [{"role": "assistant", "content": f"{a} + {b} = {a + b}" + " ok" * (i % 3)}],
                "rejected": [{"role": "assistant", "content": f"It is {wrong}."}],
            }
        )
    return rows


def ours(model: Path, data: Path, runs: Path, loss: str) -> list[float]:
    cfg = load_sft_config(
        [
            f"model.path={model}",
            f"train_datasets=[{data}]",
            "objective=dpo",
            f"dpo_loss={loss}",
            "dpo_beta=0.1",
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
    with PreferenceTrainer(cfg, say=lambda _: None) as trainer:
        return trainer.run()


def theirs(model: Path, rows: list[dict], tmp: Path, loss: str) -> list[float]:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    recorded: list[float] = []

    Recording = recording(DPOTrainer, recorded)

    args = trl_args(
        DPOConfig,
        str(tmp / "trl"),
        per_device_train_batch_size=4,
        gradient_accumulation_steps=1,
        max_steps=STEPS,
        beta=0.1,
        loss_type=[loss],
    )
    tok = AutoTokenizer.from_pretrained(model)
    trainer = Recording(
        model=str(model), args=args, train_dataset=Dataset.from_list(rows), processing_class=tok
    )
    trainer.train()
    return recorded


@pytest.mark.parametrize("loss", ["sigmoid", "ipo"])
def test_dpo_loss_per_step_equals_trl(tiny_model_dir: Path, tmp_path: Path, loss: str) -> None:
    rows = pairs()
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    skylift = ours(tiny_model_dir, data, tmp_path / "runs", loss)
    trl_losses = theirs(tiny_model_dir, rows, tmp_path, loss)
    assert len(skylift) == len(trl_losses) == STEPS
    if loss == "sigmoid":
        assert skylift[0] == pytest.approx(math.log(2), abs=1e-6)
    worst = max(abs(a - b) for a, b in zip(skylift, trl_losses, strict=True))
    assert worst < 1e-4, f"skylift {skylift}\nTRL     {trl_losses}"
    assert skylift[-1] < skylift[0]
