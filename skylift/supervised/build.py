"""From an `SFTConfig` to what a supervised run is made of: its directories, rows and worker settings.

The one place where `skylift sft`'s configuration is read (the loop, `skylift.supervised.trainer`,
only uses what is built here).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from skylift.cluster.settings import adapter_and_sharding, optimizer_settings
from skylift.config.sft import SFTConfig
from skylift.data.chat import read_examples
from skylift.supervised.tokens import TokenizedRow, tokenize_example
from skylift.worker.training_worker import WorkerSettings


def tokenized_source(
    cfg: SFTConfig, tokenizer: Any, source: str, split: str | None, say: Callable[[str], None]
) -> list[TokenizedRow]:
    """Every row of one dataset, tokenized with its assistant mask (`skylift.supervised.tokens`)."""
    examples = read_examples(source, split, cfg.messages_key, cfg.tools_key)
    last_only = cfg.train_on_what == "last_assistant_message"
    rows = [
        tokenize_example(
            tokenizer, ex, last_only, cfg.max_length, dict(cfg.chat_template_kwargs), f"{source} row {i}"
        )
        for i, ex in enumerate(examples)
    ]
    tokens = sum(len(r.ids) for r in rows)
    say(f"{source}: {len(rows)} rows, {tokens} tokens, {sum(r.loss_tokens for r in rows)} trained")
    return rows


def train_sources(cfg: SFTConfig, tokenizer: Any, say: Callable[[str], None]) -> list[list[TokenizedRow]]:
    """The train datasets' rows (one list per dataset), or a dummy run's random full-length rows."""
    if cfg.dummy_run_full_ctx:
        assert cfg.max_length is not None
        rng = random.Random(cfg.seed)
        vocab = int(getattr(tokenizer, "vocab_size", 1000))
        n = cfg.batch_size * cfg.dummy_run_max_steps
        say(f"dummy run: {n} random rows of {cfg.max_length} tokens")
        return [
            [
                TokenizedRow([rng.randrange(vocab) for _ in range(cfg.max_length)], [1] * cfg.max_length)
                for _ in range(n)
            ]
        ]
    splits = cfg.train_dataset_splits or [None] * len(cfg.train_datasets)
    return [
        tokenized_source(cfg, tokenizer, s, sp, say) for s, sp in zip(cfg.train_datasets, splits, strict=True)
    ]


def eval_sources(cfg: SFTConfig, tokenizer: Any, say: Callable[[str], None]) -> dict[str, list[TokenizedRow]]:
    splits = cfg.eval_dataset_splits or ["validation"] * len(cfg.eval_datasets)
    return {
        s: tokenized_source(cfg, tokenizer, s, sp, say)
        for s, sp in zip(cfg.eval_datasets, splits, strict=True)
    }


def total_steps(cfg: SFTConfig, steps_per_epoch: int) -> int:
    if cfg.dummy_run_full_ctx:
        return cfg.dummy_run_max_steps
    return cfg.num_steps if cfg.num_steps is not None else steps_per_epoch * cfg.num_epochs


def worker_settings(cfg: SFTConfig, steps: int) -> WorkerSettings:
    """The training ranks' model, LoRA, optimizer (schedule over `steps`), FSDP2 and micro-batching."""
    lora, fsdp = cfg.model.lora, cfg.fsdp_config
    return WorkerSettings(
        model_path=cfg.model.path,
        compute_dtype="bfloat16" if cfg.bf16 else None,
        gradient_checkpointing=cfg.gradient_checkpointing,
        optimizer=optimizer_settings(cfg.optimizer_config, steps),
        **adapter_and_sharding(lora, fsdp, lora.rank),
        sequence_parallel_size=cfg.sequence_parallel_size,
        seed=cfg.seed,
        collective_timeout_s=cfg.collective_timeout_s,
        max_tokens_per_microbatch=cfg.max_tokens_per_microbatch,
        remove_microbatch_padding=cfg.remove_microbatch_padding,
    )


__all__ = ["eval_sources", "total_steps", "train_sources", "worker_settings"]
