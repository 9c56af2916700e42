"""What a run's parts are built from: worker and optimizer settings, local engine
arguments and Ray's start-up. Pure functions of the configuration (Ray's start aside), so the
trainer reads as the loop it is.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from skylift.config.errors import ConfigError
from skylift.config.schema import AdapterConfig, FSDPConfig, LoraConfig, OptimizerConfig, SkyliftConfig
from skylift.generator import GeneratorSettings
from skylift.generator.settings import max_generate_length
from skylift.inference.engine_args import lora_engine_args
from skylift.worker.profiler import ProfilerSettings
from skylift.worker.training_worker import OptimizerSettings, WorkerSettings


def total_steps(cfg: SkyliftConfig, batches_per_epoch: int) -> int:
    """Training steps of the whole run: the batches of all epochs, at most `trainer.max_steps`."""
    t = cfg.trainer
    total = batches_per_epoch * t.epochs
    return min(total, t.max_steps) if t.max_steps is not None else total


def policy_optimizer_steps_per_step(cfg: SkyliftConfig) -> int:
    t = cfg.trainer
    return max(1, t.train_batch_size // t.policy_mini_batch_size) * t.update_epochs_per_batch


def generator_settings(cfg: SkyliftConfig) -> GeneratorSettings:
    """How the generator turns prompts into scored trajectories (`generator.*`, `environment.*`)."""
    t, g = cfg.trainer, cfg.generator
    env_class = cfg.environment.env_class
    return GeneratorSettings(
        max_prompt_length=t.max_prompt_length,
        max_generate_length=max_generate_length(cfg),
        max_turns=g.max_turns,
        max_input_length=g.max_input_length,
        zero_reward_on_non_stop=g.zero_reward_on_non_stop,
        engine_versions=t.fully_async.enabled,
        apply_overlong_filtering=g.apply_overlong_filtering,
        env_kwargs=dict(cfg.environment.env_kwargs),
        default_env_class=env_class,
        batched=g.batched,
        conversation_multi_turn=g.use_conversation_multi_turn,
        env_workers=cfg.environment.max_env_workers,
        chat_template_kwargs=dict(g.chat_template_kwargs),
        append_eos_after_stop_str=g.append_eos_token_after_stop_str_in_multi_turn,
        step_wise=g.step_wise_trajectories,
        merge_steps=g.merge_stepwise_output,
        on_template_mismatch=g.on_template_mismatch,
        llm_base_url=cfg.environment.llm_base_url,
        llm_model=cfg.environment.llm_model,
        llm_timeout_s=cfg.environment.llm_timeout_s,
        tool_timeout_s=cfg.environment.tool_timeout_s,
        max_concurrent_tool_calls=cfg.environment.max_concurrent_tool_calls,
        resubmit_aborted=t.fully_async.enabled and t.fully_async.pause_mode == "abort",
        routed_experts=g.enable_return_routed_experts,
    )


def optimizer_settings(o: OptimizerConfig, total_steps: int) -> OptimizerSettings:
    """A training worker's optimizer: the config group as it is (`total_steps`: its optimizer
    steps in the run)."""
    return OptimizerSettings(o, total_steps=total_steps)


def adapter_and_sharding(lora: LoraConfig | AdapterConfig, fsdp: FSDPConfig, rank: int) -> dict[str, Any]:
    """A training worker's LoRA adapter (`rank` 0: none) and FSDP2 settings from their config groups
    (`skylift train`'s and `skylift sft`'s have the same keys)."""
    return {
        "lora_rank": rank,
        "lora_alpha": lora.alpha,
        "lora_target_modules": lora.target_modules,
        "lora_dropout": lora.dropout,
        "reshard_after_forward": fsdp.reshard_after_forward,
        "cpu_offload": fsdp.cpu_offload,
        "fsdp_size": fsdp.fsdp_size,
    }


def model_worker_settings(cfg: SkyliftConfig, trainable: bool, total_steps: int) -> WorkerSettings:
    """The policy (`trainable`) or the frozen reference model; `total_steps`: training steps."""
    t = cfg.trainer
    model_cfg = t.policy.model if trainable else t.ref.model
    fsdp = t.policy.fsdp_config if trainable else t.ref.fsdp_config
    lora = t.policy.model.lora  # the reference is the frozen base model: no adapter
    return WorkerSettings(
        model_path=model_cfg.path or t.policy.model.path,
        trainable=trainable,
        compute_dtype="bfloat16" if t.bf16 else None,
        gradient_checkpointing=t.gradient_checkpointing,
        optimizer=optimizer_settings(
            t.policy.optimizer_config, total_steps * policy_optimizer_steps_per_step(cfg)
        ),
        **adapter_and_sharding(lora, fsdp, lora.rank if trainable else 0),
        sequence_parallel_size=(t.policy if trainable else t.ref).sequence_parallel_size,
        seed=t.seed,
        collective_timeout_s=t.collective_timeout_s,
        profiler=profiler_settings(cfg) if trainable else None,
        **micro_batch_settings(cfg),
    )


def profiler_settings(cfg: SkyliftConfig) -> ProfilerSettings | None:
    """`trainer.policy.torch_profiler_config`: which steps and ranks the policy traces, and where."""
    p, t = cfg.trainer.policy.torch_profiler_config, cfg.trainer
    if not p.enable:
        return None
    if p.export_type == "stacks" and not p.with_stack:
        raise ConfigError(
            "trainer.policy.torch_profiler_config.export_type=stacks needs "
            "trainer.policy.torch_profiler_config.with_stack=true"
        )
    return ProfilerSettings(
        save_path=str(Path(p.save_path or Path(t.log_dir or ".") / "profiles").expanduser()),
        ranks=tuple(p.ranks),
        skip_first=p.skip_first,
        wait=p.wait,
        warmup=p.warmup,
        active=p.active,
        repeat=p.repeat,
        activities=tuple(p.activities),
        record_shapes=p.record_shapes,
        profile_memory=p.profile_memory,
        with_stack=p.with_stack,
        with_flops=p.with_flops,
        with_modules=p.with_modules,
        use_gzip=p.use_gzip,
        export_type=p.export_type,
        optimizer_steps_per_step=policy_optimizer_steps_per_step(cfg),
    )


def micro_batch_settings(cfg: SkyliftConfig) -> dict[str, Any]:
    """The workers' micro-batching keys (token budget, packing)."""
    t = cfg.trainer
    budget = t.max_tokens_per_microbatch
    return {
        "max_tokens_per_microbatch": budget if budget > 0 else None,
        "remove_microbatch_padding": t.remove_microbatch_padding,
        "share_prefixes": t.share_prefixes,
    }


def critic_worker_settings(cfg: SkyliftConfig, total_steps: int) -> WorkerSettings:
    """The value model (the critic's model path, else the policy's backbone with a value head)."""
    t = cfg.trainer
    critic_steps = max(1, t.train_batch_size // t.critic_mini_batch_size) * t.update_epochs_per_batch
    lora = t.critic.model.lora  # adapters on the backbone; the value head trains in full
    return WorkerSettings(
        model_path=t.critic.model.path or t.policy.model.path,
        head="value",
        compute_dtype="bfloat16" if t.bf16 else None,
        gradient_checkpointing=t.gradient_checkpointing,
        optimizer=optimizer_settings(t.critic.optimizer_config, total_steps * critic_steps),
        lora_rank=lora.rank,
        lora_alpha=lora.alpha,
        lora_target_modules=lora.target_modules,
        lora_dropout=lora.dropout,
        reshard_after_forward=t.critic.fsdp_config.reshard_after_forward,
        cpu_offload=t.critic.fsdp_config.cpu_offload,
        fsdp_size=t.critic.fsdp_config.fsdp_size,
        sequence_parallel_size=t.critic.sequence_parallel_size,
        seed=t.seed,
        collective_timeout_s=t.collective_timeout_s,
        **micro_batch_settings(cfg),
    )


#: vLLM's CPU attention backend takes KV-cache blocks of a multiple of this many tokens only (its
#: engine dies at start-up with "No common block size" otherwise).
CPU_BLOCK_MULTIPLE = 32


def local_engine_kwargs(cfg: SkyliftConfig, sleep_mode: bool, lora_adapter: bool = True) -> dict[str, Any]:
    """`LocalVLLMEngine.create` arguments of the run's local engines; `lora_adapter`: a LoRA
    policy syncs its adapter, so the engines serve LoRA (`skylift.cluster.lora_run`)."""
    g, t = cfg.generator, cfg.trainer
    kwargs: dict[str, Any] = {
        "max_model_len": t.max_prompt_length + max_generate_length(cfg) * max(1, g.max_turns),
        "seed": t.seed,
        "dtype": g.model_dtype,
        "enable_prefix_caching": g.enable_prefix_caching,
        "max_num_seqs": g.max_num_seqs,
        "tensor_parallel_size": g.inference_engine_tensor_parallel_size,
        "enforce_eager": g.enforce_eager,
        "enable_chunked_prefill": g.enable_chunked_prefill,
        "max_num_batched_tokens": g.max_num_batched_tokens,
        "generate_timeout_s": g.http_timeout_s,
    }
    if torch.cuda.is_available():
        kwargs["gpu_memory_utilization"] = g.gpu_memory_utilization
    if g.kv_cache_block_size is not None:
        if not torch.cuda.is_available() and g.kv_cache_block_size % CPU_BLOCK_MULTIPLE:
            raise ConfigError(
                f"generator.kv_cache_block_size={g.kv_cache_block_size}: vLLM's CPU attention needs a "
                f"multiple of {CPU_BLOCK_MULTIPLE} (e.g. 32, 64 or 128)",
                key="generator.kv_cache_block_size",
            )
        kwargs["block_size"] = g.kv_cache_block_size
    if g.kv_cache_gb is not None:
        kwargs["kv_cache_memory_bytes"] = int(g.kv_cache_gb * (1 << 30))
    if sleep_mode:
        kwargs["enable_sleep_mode"] = True
    if g.enable_return_routed_experts:  # routing replay: vLLM captures each token's experts
        kwargs["enable_return_routed_experts"] = True
    if lora_adapter:  # engines serve the base model plus the synced adapter (skylift.weight_sync.lora)
        kwargs.update(lora_engine_args(t.policy.model.lora.rank))
    kwargs.update(g.engine_init_kwargs)  # vLLM engine args as given (generator.engine_init_kwargs)
    return kwargs
