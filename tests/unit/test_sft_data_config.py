"""`skylift sft`'s batches, configuration and SkyRL's SFT keys.

The batch of a step depends on the seed and the step alone (a resumed run sees the same rows),
several datasets mix by weight in every batch, each epoch uses every row once; the configuration
refuses what is wrong with one line naming the key; SkyRL's ``main_sft`` keys are read or refused.
"""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from skylift.config.errors import ConfigError
from skylift.config.sft import load_sft_config
from skylift.supervised.data import StepBatches, sequence_batch
from skylift.supervised.tokens import TokenizedRow


def rows(tag: int, n: int) -> list[TokenizedRow]:
    return [TokenizedRow([tag, i, 7], [0, 1, 1]) for i in range(n)]


def test_an_epoch_uses_every_row_once_and_a_step_depends_on_the_seed_and_step_only() -> None:
    data = StepBatches([rows(1, 10), rows(2, 6)], batch_size=4, seed=3)
    assert data.steps_per_epoch == 4
    epoch = [tuple(r.ids) for s in range(4) for r in data.rows(s)]
    assert len(set(epoch)) == 16
    again = StepBatches([rows(1, 10), rows(2, 6)], batch_size=4, seed=3)
    assert [r.ids for r in again.rows(6)] == [r.ids for r in data.rows(6)]
    assert [r.ids for r in data.rows(4)] != [r.ids for r in data.rows(0)]  # a new permutation
    ordered = StepBatches([rows(1, 8)], batch_size=4, shuffle=False)
    assert [r.ids[1] for r in ordered.rows(1)] == [4, 5, 6, 7]


def test_weights_mix_every_batch_and_a_source_repeats_only_after_all_its_rows() -> None:
    data = StepBatches([rows(1, 5), rows(2, 40)], batch_size=4, seed=0, weights=[1, 1])
    for step in range(6):
        assert Counter(r.ids[0] for r in data.rows(step)) == {1: 2, 2: 2}
    small = [r.ids[1] for s in range(5) for r in data.rows(s) if r.ids[0] == 1]  # 10 rows of 5
    assert sorted(small[:5]) == [0, 1, 2, 3, 4] and sorted(small[5:]) == [0, 1, 2, 3, 4]
    uneven = StepBatches([rows(1, 50), rows(2, 50)], batch_size=4, seed=0, weights=[3, 1])
    assert Counter(r.ids[0] for s in range(10) for r in uneven.rows(s)) == {1: 30, 2: 10}
    assert [r.ids for r in uneven.rows(7)] == [r.ids for r in uneven.rows(7)]


def test_rows_become_one_token_prompts_and_masked_responses() -> None:
    batch = sequence_batch([TokenizedRow([5, 6, 7, 8], [0, 0, 1, 1]), TokenizedRow([5, 9], [0, 1])], 0)
    assert batch.prompt_len == 1
    assert batch.response_mask.tolist() == [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]


def test_keys_values_and_combinations_are_checked_with_one_line_each() -> None:
    cfg = load_sft_config(["model.path=tiny-qwen2", "train_datasets=[a.jsonl]", "model.lora.rank=8"])
    assert cfg.model.lora.rank == 8 and cfg.batch_size == 4
    with pytest.raises(ConfigError, match="unknown sft config key bach_size; did you mean batch_size"):
        load_sft_config(["train_datasets=[a.jsonl]", "bach_size=3"])
    with pytest.raises(ConfigError, match="invalid value for batch_size"):
        load_sft_config(["train_datasets=[a.jsonl]", "batch_size=many"])
    with pytest.raises(ConfigError, match="train_datasets must name at least one dataset"):
        load_sft_config([])
    with pytest.raises(
        ConfigError, match=r"train_dataset_weights needs one entry per entry of train_datasets"
    ):
        load_sft_config(["train_datasets=[a.jsonl,b.jsonl]", "train_dataset_weights=[1.0]"])
    with pytest.raises(ConfigError, match="train_on_what='everything' is not one of"):
        load_sft_config(["train_datasets=[a.jsonl]", "train_on_what=everything"])


SKYRL_FSDP = [
    "strategy=fsdp",
    "model.path=Qwen/Qwen2.5-0.5B-Instruct",
    "model.lora.rank=32",
    "model.lora.alpha=16",
    "model.lora.target_modules=all-linear",
    "train_datasets=['yahma/alpaca-cleaned']",
    "train_dataset_splits=['train[:100]']",
    "messages_key=messages",
    "max_length=512",
    "num_steps=10",
    "batch_size=4",
    "micro_train_batch_size_per_gpu=2",
    "remove_microbatch_padding=true",
    "optimizer_config.scheduler=constant_with_warmup",
    "placement.num_nodes=1",
    "placement.num_gpus_per_node=1",
    "fsdp_config.cpu_offload=false",
    "logger=console",
    'ckpt_path=""',
    "ckpt_interval=0",
    'resume_from=""',
]


def test_skyrls_sft_keys_are_read_and_megatron_is_refused(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_sft_config(SKYRL_FSDP)  # a Hub name: read when the run starts, not here
    assert cfg.train_datasets == ["yahma/alpaca-cleaned"] and cfg.model.lora.rank == 32
    cfg = load_sft_config(
        [
            "dataset_name=a.jsonl",
            "use_sample_packing=false",
            "sampler=sequential",
            "max_training_steps=3",
            "num_steps=10",
        ]
    )
    assert cfg.train_datasets == ["a.jsonl"] and not cfg.remove_microbatch_padding and not cfg.shuffle
    assert cfg.num_steps == 3
    with caplog.at_level(logging.WARNING, logger="skylift.config"):
        load_sft_config(["train_datasets=[a.jsonl]", "num_workers=4"])
    assert "num_workers=4 has no effect in skylift" in caplog.text
    for megatron in (["strategy=megatron"], ["megatron_config.tensor_model_parallel_size=2"]):
        with pytest.raises(ConfigError, match="skylift has no Megatron backend"):
            load_sft_config([*SKYRL_FSDP, *megatron])
    with pytest.raises(ConfigError, match="pretokenized_dataset_paths: pretokenized datasets are not read"):
        load_sft_config(["pretokenized_dataset_paths=[/data/x]"])
