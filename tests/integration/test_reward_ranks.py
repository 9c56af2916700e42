"""`skylift sft objective=reward` on 2 FSDP2 ranks (Ray actors over gloo) takes the steps 1 rank
takes: the same loss per step, each rank half of every step's pairs and a shard of the weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_reward_trl_parity import pairs

from skylift.config.sft import load_sft_config
from skylift.supervised.reward import RewardModelTrainer

pytestmark = pytest.mark.integration


def losses(model: Path, data: Path, runs: Path, *extra: str) -> list[float]:
    cfg = load_sft_config(
        [
            f"model.path={model}",
            f"train_datasets=[{data}]",
            "objective=reward",
            "batch_size=4",
            "micro_train_batch_size_per_gpu=1",
            "num_steps=4",
            "optimizer_config.lr=1e-3",
            f"runs_dir={runs}",
            *extra,
        ]
    )
    with RewardModelTrainer(cfg, say=lambda _: None) as trainer:
        return trainer.run()


def test_two_ranks_over_gloo_equal_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in pairs("conversational_margin", 16)))
    one = losses(tiny_model_dir, data, tmp_path / "one", "placement.backend=local")
    two = losses(
        tiny_model_dir, data, tmp_path / "two", "placement.backend=ray", "placement.num_gpus_per_node=2"
    )
    assert two == pytest.approx(one, abs=1e-5)
    assert one[-1] < one[0]
