"""`skylift sft` end to end on the tiny model, in this process: the command's progress lines, an
exact resume from a checkpoint (same rows, same optimizer state), LoRA, and the exported model."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sft_trl_parity import chat_rows, write_jsonl

from skylift.cli import main
from skylift.config.sft import load_sft_config
from skylift.supervised.trainer import SupervisedTrainer


def overrides(model: Path, data: Path, runs: Path, *extra: str) -> list[str]:
    return [
        f"model.path={model}",
        f"train_datasets=[{data}]",
        "batch_size=4",
        "micro_train_batch_size_per_gpu=2",
        "num_steps=4",
        "optimizer_config.lr=1e-3",
        "optimizer_config.scheduler=cosine",
        "optimizer_config.num_warmup_steps=1",
        "placement.backend=local",
        f"runs_dir={runs}",
        *extra,
    ]


def test_resume_continues_exactly_and_the_export_loads(tiny_model_dir: Path, tmp_path: Path) -> None:
    data = write_jsonl(chat_rows(24), tmp_path / "chats.jsonl")
    whole = load_sft_config(overrides(tiny_model_dir, data, tmp_path / "a"))
    with SupervisedTrainer(whole, say=lambda _: None) as trainer:
        expected = trainer.run()
        export = trainer.paths.export / "global_step_4"
    cfg = load_sft_config(overrides(tiny_model_dir, data, tmp_path / "b"))
    with SupervisedTrainer(cfg, say=lambda _: None) as first:  # interrupted after step 2
        for step in range(2):
            first.losses.append(first.train_step(first.batches.rows(step))["loss"])
        first.save_checkpoint(2)
    resumed = load_sft_config(overrides(tiny_model_dir, data, tmp_path / "b", "resume_from=latest"))
    with SupervisedTrainer(resumed, say=lambda _: None) as second:
        losses = second.run()
    assert losses == pytest.approx(expected, abs=1e-6)
    assert losses[-1] < losses[0]

    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, base.get_parameter(n))]
    assert changed  # the trained weights, not the base model's


def test_the_command_prints_a_line_per_step_and_trains_lora(
    tiny_model_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = write_jsonl(chat_rows(16), tmp_path / "chats.jsonl")
    args = overrides(
        tiny_model_dir, data, tmp_path, "model.lora.rank=4", f"eval_datasets=[{data}]", "eval_interval=2"
    )
    assert main(["sft", *args]) == 0
    out = capsys.readouterr().out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 4 and all("| loss " in s and "tok/s" in s for s in steps)
    assert out.count("eval @ step") == 2 and "LoRA rank 4" in out and "done: 4 steps" in out
    assert (
        main(
            [
                "sft",
                f"model.path={tiny_model_dir}",
                "train_datasets=[missing.jsonl]",
                "placement.backend=local",
            ]
        )
        == 2
    )
    assert "missing.jsonl: no such file" in capsys.readouterr().err
