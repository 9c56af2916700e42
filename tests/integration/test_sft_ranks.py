"""`skylift sft` on 2 FSDP2 ranks (Ray actors over gloo) takes the steps 1 rank takes: the same
loss per step, each rank a shard of the rows and of the weights."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sft_trl_parity import chat_rows, write_jsonl

from skylift.config.sft import load_sft_config
from skylift.supervised.trainer import SupervisedTrainer

pytestmark = pytest.mark.integration


def losses(model: Path, data: Path, runs: Path, *extra: str, setups: list | None = None) -> list[float]:
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
        out = trainer.run()
        if setups is not None:
            setups += trainer.rank_setups
        return out


def test_two_ranks_over_gloo_equal_one_rank(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(chat_rows(24), tmp_path / "chats.jsonl")
    one = losses(tiny_model_dir, data, tmp_path / "one", "placement.backend=local")
    two = losses(
        tiny_model_dir, data, tmp_path / "two", "placement.backend=ray", "placement.num_gpus_per_node=2"
    )
    assert two == pytest.approx(one, abs=1e-5)
    assert one[-1] < one[0]


def test_a_mixture_of_experts_on_two_ranks_shards_its_experts_and_equals_one_rank(tmp_path: Path) -> None:
    """tiny-qwen3-moe (experts fused in one tensor per layer, as transformers 5 keeps them): FSDP2
    shards every parameter, the experts' tensors included, along their first dimension (the
    experts), so each rank holds half; the steps equal one rank's."""
    from skylift.models import prepare_model

    model = prepare_model("tiny-qwen3-moe")
    data = write_jsonl(chat_rows(12), tmp_path / "chats.jsonl")
    steps = ("num_steps=2", "batch_size=4")
    one = losses(model, data, tmp_path / "one", "placement.backend=local", *steps)
    setups: list = []
    two = losses(
        model,
        data,
        tmp_path / "two",
        "placement.backend=ray",
        "placement.num_gpus_per_node=2",
        *steps,
        setups=setups,
    )
    assert two == pytest.approx(one, abs=1e-5)
    assert [s["rank"] for s in setups] == [0, 1]
    assert sum(s["local_params"] for s in setups) == setups[0]["params"]  # a shard each, nothing twice
    assert all(0.45 < s["local_params"] / s["params"] < 0.55 for s in setups), setups
