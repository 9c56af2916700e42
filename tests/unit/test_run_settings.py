"""The settings a run's workers and engines are built from (skylift.cluster.settings)."""

from __future__ import annotations

import pytest
import torch

from skylift.cluster.settings import (
    critic_worker_settings,
    local_engine_kwargs,
    model_worker_settings,
    policy_optimizer_steps_per_step,
)
from skylift.config import ConfigError, load_config


def test_policy_and_reference_settings() -> None:
    cfg = load_config(
        [
            "trainer.policy.model.path=/models/policy",
            "trainer.policy.model.lora.rank=8",
            "trainer.train_batch_size=8",
            "trainer.policy_mini_batch_size=2",
            "trainer.update_epochs_per_batch=2",
            "trainer.policy.optimizer_config.max_grad_norm=0",
        ]
    )
    assert policy_optimizer_steps_per_step(cfg) == 8
    policy = model_worker_settings(cfg, trainable=True, total_steps=10)
    assert policy.trainable and policy.lora_rank == 8 and policy.model_path == "/models/policy"
    assert policy.optimizer.total_steps == 80  # the scheduler spans every optimizer step of the run
    # the optimizer_config group as it is; its max_grad_norm 0 disables clipping in the worker
    # (test_training_worker.py::test_a_clip_norm_of_zero_disables_clipping)
    assert policy.optimizer.config is cfg.trainer.policy.optimizer_config
    assert policy.optimizer.config.max_grad_norm == 0
    reference = model_worker_settings(cfg, trainable=False, total_steps=10)
    assert not reference.trainable and reference.lora_rank == 0  # the frozen base model
    assert reference.model_path == "/models/policy"  # ref.model.path unset: the policy's
    assert reference.collective_timeout_s == policy.collective_timeout_s == 600.0


def test_critic_settings_count_critic_mini_batches() -> None:
    cfg = load_config(
        [
            "trainer.policy.model.path=/models/policy",
            "trainer.train_batch_size=8",
            "trainer.policy_mini_batch_size=8",
            "trainer.critic_mini_batch_size=4",
        ]
    )
    critic = critic_worker_settings(cfg, total_steps=5)
    assert critic.head == "value" and critic.model_path == "/models/policy"
    assert critic.optimizer.total_steps == 10


def test_local_engine_arguments() -> None:
    cfg = load_config(
        [
            "trainer.max_prompt_length=100",
            "generator.max_generate_length=50",
            "generator.kv_cache_gb=0.5",
            "generator.http_timeout_s=42",
        ]
    )
    kwargs = local_engine_kwargs(cfg, sleep_mode=False)
    assert kwargs["max_model_len"] == 150
    assert kwargs["kv_cache_memory_bytes"] == 1 << 29
    assert kwargs["generate_timeout_s"] == 42
    assert "enable_sleep_mode" not in kwargs
    assert local_engine_kwargs(cfg, sleep_mode=True)["enable_sleep_mode"] is True
    assert "block_size" not in kwargs  # vLLM's default
    blocks = load_config(["generator.kv_cache_block_size=32"])
    assert local_engine_kwargs(blocks, sleep_mode=False)["block_size"] == 32


def test_a_cpu_block_size_vllm_cannot_take_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's CPU engine would die at start-up ("No common block size for 16"); skylift says why first."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        ConfigError, match=r"kv_cache_block_size=16: vLLM's CPU attention needs a multiple of 32"
    ):
        local_engine_kwargs(load_config(["generator.kv_cache_block_size=16"]), sleep_mode=False)
    assert (
        local_engine_kwargs(load_config(["generator.kv_cache_block_size=64"]), sleep_mode=False)["block_size"]
        == 64
    )
