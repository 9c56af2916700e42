"""`skylift train` rewarded by a reward model: 2 GRPO steps on the tiny model, every rollout scored
by the ``reward_model`` environment's default scorer (a Ray actor holding the model in torch)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from skylift.config import load_config
from skylift.data import write_arithmetic_dataset
from skylift.envs.reward_model import close_scorers
from skylift.rl.build import build_trainer

pytestmark = pytest.mark.integration


def test_two_grpo_steps_rewarded_by_a_reward_model(tiny_model_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    from skylift.models.reward_model import load_reward_model

    rm = tmp_path / "rm"
    torch.manual_seed(5)  # an untrained head: its scores still differ between responses
    load_reward_model(str(tiny_model_dir)).save_pretrained(rm)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(rm)
    data = tmp_path / "data"
    write_arithmetic_dataset(data, num_train=16, num_val=4, seed=0)
    table = pq.read_table(data / "train.parquet")
    column = pa.array(["reward_model"] * table.num_rows)
    table = table.set_column(table.schema.get_field_index("env_class"), "env_class", column)
    pq.write_table(table, data / "train.parquet")
    overrides = {
        "trainer.policy.model.path": str(tiny_model_dir),
        "data.train_data": f"['{data / 'train.parquet'}']",
        "data.val_data": "[]",
        "environment.env_kwargs.path": str(rm),
        "trainer.train_batch_size": 2,
        "trainer.policy_mini_batch_size": 2,
        "trainer.micro_train_batch_size_per_gpu": 4,
        "generator.n_samples_per_prompt": 4,
        "generator.max_generate_length": 12,
        "trainer.max_prompt_length": 128,
        "trainer.eval_before_train": "false",
        "trainer.eval_interval": 0,
        "trainer.max_steps": 2,
        "trainer.policy.optimizer_config.lr": 1e-3,
        "trainer.ckpt_path": str(tmp_path / "ckpts"),
        "trainer.export_path": str(tmp_path / "exports"),
        "trainer.log_dir": str(tmp_path / "logs"),
    }
    trainer = build_trainer(load_config([f"{k}={v}" for k, v in overrides.items()]), console=False)
    try:
        trainer.setup()
        history = trainer.fit()
    finally:
        close_scorers()
        trainer.shutdown()
    steps = [h for h in history if "reward/mean" in h]
    assert [h["step"] for h in steps] == [1, 2]
    for row in steps:
        # every reward is the reward model's score (the environment's own reward is 0)
        assert row["reward/mean"] == pytest.approx(row["env/group/reward_model_score"], abs=1e-5)
        assert row["reward/mean"] != 0.0
        assert row["policy/grad_norm"] > 0  # the scores differ within groups
