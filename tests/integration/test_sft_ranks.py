"""`skylift sft` on 2 FSDP2 ranks (Ray actors over gloo) takes the steps 1 rank takes: the same
loss per step, each rank a shard of the rows and of the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sft_trl_parity import chat_rows, write_jsonl

from skylift.config.sft import load_sft_config
from skylift.supervised.trainer import SupervisedTrainer

pytestmark = pytest.mark.integration


def losses(model: Path, data: Path, runs: Path, *extra: str) -> list[float]:
    cfg = load_sft_config(
        [
            f"model.path={model}",
            f"train_datasets=[{data}]",
            "batch_size=6",
            "micro_train_batch_size_per_gpu=2",
            "num_steps=4",
            "optimizer_config.lr=1e-3",
            f"runs_dir={runs}",
            *extra,
        ]
    )
    with SupervisedTrainer(cfg, say=lambda _: None) as trainer:
        return trainer.run()


def test_two_ranks_over_gloo_equal_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(chat_rows(24), tmp_path / "chats.jsonl")
    one = losses(tiny_model_dir, data, tmp_path / "one", "placement.backend=local")
    two = losses(
        tiny_model_dir, data, tmp_path / "two", "placement.backend=ray", "placement.num_gpus_per_node=2"
    )
    assert two == pytest.approx(one, abs=1e-5)
    assert one[-1] < one[0]
