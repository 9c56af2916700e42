"""SkyRL keys outside skylift's schema: accepted without effect, refused as not implemented, or
read only by SkyRL's example generators; the SkyRL dialect of the loader (`keys`) reads these tables.
"""

from __future__ import annotations

from typing import Any

ANY = "<any>"
"""Default of a wildcard entry: any value but null, false, 0, an empty list or mapping, or an
interpolation (``${...}``, SkyRL's YAML file fills its groups with them) counts as set."""


def is_default(value: Any, default: Any) -> bool:
    """Whether a SkyRL-only key set to `value` keeps SkyRL's `default` (see `ANY`)."""
    if default == ANY:
        return value in (None, False, 0, [], {}) or (isinstance(value, str) and value.startswith("${"))
    return bool(value == default)


_ROLES = ("policy", "ref", "critic")
_LORA_EXTRA = {
    "exclude_modules": None,
    "init_method": "kaiming",
    "sync_mode": "disk",
    "share_expert_adapters": True,
    "max_loras": 1,
    "max_cpu_loras": None,
}

_LORA_ALL = {
    "rank": 0,
    "alpha": 16,
    "dropout": 0,
    "target_modules": "all-linear",
    "lora_sync_path": "/tmp/skyrl_lora_sync",
    **_LORA_EXTRA,
}

#: SkyRL key (``*`` matches one or more parts) -> (SkyRL's default, why it has no effect here).
#: Set aside by the loader; a value other than the default logs a warning with the reason.
SKYRL_WITHOUT_EFFECT: dict[str, tuple[Any, str]] = {
    **{
        f"trainer.{r}.fsdp_config.mixed_precision*": (
            ANY,
            "skylift's precision is trainer.bf16 (autocast over float32 weights)",
        )
        for r in _ROLES
    },
    **{
        f"trainer.{r}.fsdp_config.wrap_policy*": (
            ANY,
            "skylift shards every decoder layer; no other wrap policy",
        )
        for r in _ROLES
    },
    **{
        f"trainer.{r}.model_config_kwargs*": (
            ANY,
            "not implemented yet: overrides of the Hugging Face model config",
        )
        for r in _ROLES
    },
    **{
        f"trainer.{r}.deepspeed_config*": (ANY, "read only by trainer.strategy=deepspeed (refused)")
        for r in _ROLES
    },
    "deepspeed_config.*": (ANY, "read only by trainer.strategy=deepspeed (refused)"),
    **{
        f"trainer.{r}.model.fake_int4_qat.*": (
            ANY,
            "Megatron-only in SkyRL (skylift has no Megatron backend)",
        )
        for r in _ROLES
    },
    **{
        f"trainer.{r}.language_model_only": (False, "skylift trains text-only models")
        for r in ("policy", "ref")
    },
    "trainer.policy.inference_only_init": (False, "skylift always loads the policy for training"),
    "trainer.policy.use_torch_compile": (False, "not implemented: no torch.compile of the logits"),
    "trainer.policy.record_memory": (False, "not implemented: no CUDA memory snapshots"),
    **{
        f"trainer.{role}.model.lora.{name}": (default, "not implemented: skylift's LoRA has no such setting")
        for role in ("policy", "critic")
        for name, default in _LORA_EXTRA.items()
    },
    "trainer.critic.model.lora.lora_sync_path": (
        "/tmp/skyrl_lora_sync",
        "the critic's adapter stays with its workers (engines serve the policy only)",
    ),
    **{
        f"trainer.ref.model.lora.{name}": (
            default,
            "the reference model is frozen (SkyRL's schema shares its model group)",
        )
        for name, default in _LORA_ALL.items()
    },
    "trainer.algorithm.temperature": (
        None,
        "logits are always divided by generator.sampling_params.temperature (SkyRL's default for it)",
    ),
    "trainer.algorithm.value_head_prefix": ("value_head", "skylift's critic names its own value head"),
    "trainer.algorithm.use_kl_estimator_k3": (False, "deprecated in SkyRL: set kl_estimator_type=k3"),
    "trainer.algorithm.use_abs_kl": (False, "deprecated in SkyRL; the abs estimator is not implemented"),
    "trainer.algorithm.cispo.cispo_anchor": ("old", "skylift's cispo weights anchor on the old logprobs"),
    "trainer.algorithm.entropy_loss_coef": (0.01, "read only by use_entropy_loss (not implemented yet)"),
    "trainer.mtp.*": (ANY, "multi-token prediction is Megatron-only in SkyRL"),
    "trainer.fully_async.clear_kv_cache_on_weight_sync": (
        False,
        "not implemented yet: skylift's engines reset their prefix cache at every weight sync anyway",
    ),
    "trainer.fully_async.simulate_*": (ANY, "SkyRL's simulation mode of fully async runs is not implemented"),
    "trainer.use_expandable_segments": (True, "skylift leaves PyTorch's CUDA allocator settings alone"),
    "trainer.enable_ray_gpu_monitor": (True, "not implemented: no Ray GPU monitor"),
    "trainer.tags": (None, "not implemented: trackers get no tags"),
    "trainer.print_example_interval": (1, "skylift's console prints no example rollouts"),
    "trainer.log_example_interval": (-1, "skylift logs no example rollouts to trackers"),
    "trainer.num_logger_eval_samples": (-1, "skylift logs no example rollouts to trackers"),
    "trainer.num_logger_train_samples": (-1, "skylift logs no example rollouts to trackers"),
    "trainer.logprobs_chunk_size": (
        1024,
        "skylift computes logprobs per micro-batch, not in vocabulary chunks",
    ),
    "trainer.vocab_entropy_chunk_size": (0, "skylift logs no per-token entropy"),
    "trainer.vocab_entropy_chunk_memory_mb": (512, "skylift logs no per-token entropy"),
    "trainer.fused_lm_head_logprob": (False, "not implemented: no fused LM-head logprob kernel"),
    "trainer.fused_lm_head_logprob_backend": ("torch", "not implemented: no fused LM-head logprob kernel"),
    "trainer.recompute_old_logprobs_per_minibatch": (
        True,
        "old logprobs come from the rollouts or once per batch (see trainer.async_training)",
    ),
    "trainer.update_ref_every_epoch": (False, "not implemented: the reference model never changes"),
    "trainer.flash_attn": (
        True,
        "skylift chooses the attention kernel itself (sdpa; flash-attn is not installed)",
    ),
    "trainer.disable_fast_tokenizer": (False, "skylift always loads the fast tokenizer"),
    "trainer.gradient_checkpointing_use_reentrant": (
        False,
        "skylift's activation checkpointing is non-reentrant",
    ),
    "trainer.rope_scaling*": (None, "not implemented yet: RoPE scaling overrides"),
    "trainer.rope_theta": (None, "not implemented yet: RoPE overrides"),
    "trainer.target_modules": (None, "deprecated in SkyRL: set trainer.policy.model.lora.target_modules"),
    "trainer.exclude_modules": (None, "deprecated in SkyRL, and skylift's LoRA excludes no modules"),
    "data.dataloader.*": (ANY, "skylift reads prompts in the trainer's process, without DataLoader workers"),
    "generator.model_name": (ANY, "engines serve trainer.policy.model.path"),  # an interpolation in SkyRL
    # not in SkyRL's schema either: its step_wise example adds it with `+`, and SkyRL's generator never
    # reads it (it retokenizes the chat history when use_conversation_multi_turn has a custom template)
    "generator.retokenize_chat_history": (
        ANY,
        "SkyRL's code never reads it (an example adds it with +); skylift keeps each turn's sampled tokens",
    ),
    "generator.rope_scaling*": (ANY, "not implemented yet: RoPE overrides"),
    "generator.rope_theta": (ANY, "not implemented yet: RoPE overrides"),
    "generator.chat_template.source": (
        "name",
        "not implemented yet: prompts use the tokenizer's own chat template",
    ),
    "generator.chat_template.name_or_path": (
        None,
        "not implemented yet: prompts use the tokenizer's own chat template",
    ),
    "generator.use_cache_salt": (True, "not implemented: prefix caching is shared between requests"),
    "generator.sampling_params.additional_kwargs*": (
        None,
        "not implemented yet: no extra sampling arguments",
    ),
    "generator.eval_sampling_params.additional_kwargs*": (
        None,
        "not implemented yet: no extra sampling arguments",
    ),
    "generator.enable_http_endpoint": (False, "run `skylift serve` for an OpenAI-compatible endpoint"),
    "generator.http_endpoint_host": ("127.0.0.1", "run `skylift serve` for an OpenAI-compatible endpoint"),
    "generator.http_endpoint_port": (8000, "run `skylift serve` for an OpenAI-compatible endpoint"),
}

_ENGINE_WITHOUT_EFFECT: dict[str, tuple[Any, str]] = {
    "pipeline_parallel_size": (1, "not implemented: local engines use tensor parallelism only"),
    "expert_parallel_size": (1, "not implemented: local engines use tensor parallelism only"),
    "data_parallel_size": (1, "set generator.inference_engine.num_engines for more engines"),
    "vllm_v1_disable_multiproc": (True, "skylift's engines choose vLLM's process layout themselves"),
    "fully_sharded_loras": (False, "not implemented: vLLM's default LoRA layout"),
    "weight_transfer_threshold_cuda_ipc_GB": (1.0, "skylift syncs weights in buckets of its own size"),
    "distributed_executor_backend": ("ray", "skylift's engines choose vLLM's executor themselves"),
    "enable_ray_prometheus_stats": (True, "not implemented: no Ray Prometheus metrics"),
    "offload_kv_for_weight_sync": (False, "not implemented: the KV cache stays during weight syncs"),
    "use_expandable_segments": (False, "skylift leaves PyTorch's CUDA allocator settings alone"),
    "served_model_name": (None, "not implemented: engines serve under the model's path"),
    "language_model_only": (False, "skylift's engines serve text-only models"),
    "speculative_config*": (None, "not implemented yet: no speculative decoding"),
    "enable_pd": (False, "not implemented: no prefill/decode disaggregation"),
    "num_prefill": (0, "not implemented: no prefill/decode disaggregation"),
    "prefill_init_kwargs*": (ANY, "not implemented: no prefill/decode disaggregation"),
    "decode_init_kwargs*": (ANY, "not implemented: no prefill/decode disaggregation"),
    "router_init_kwargs*": (ANY, "not implemented: no prefill/decode disaggregation"),
    "fp8_weight_sync_mode": (None, "FP8 weight sync is Megatron-only in SkyRL"),
    "enable_return_sample_support_set": (False, "not implemented: no sample-support replay"),
}
for _name, _entry in _ENGINE_WITHOUT_EFFECT.items():
    SKYRL_WITHOUT_EFFECT[f"generator.inference_engine.{_name}"] = _entry
    if "*" not in _name and _name not in ("data_parallel_size",):
        SKYRL_WITHOUT_EFFECT.setdefault(f"generator.{_name}", _entry)  # the seed's flat names
for _name in ("pipeline_parallel_size", "expert_parallel_size", "data_parallel_size"):
    SKYRL_WITHOUT_EFFECT[f"generator.inference_engine_{_name}"] = _ENGINE_WITHOUT_EFFECT[_name]

_RELOAD_ONLY = (
    "skylift loads the changed tensors into the running engine instead of reloading the whole "
    "patched checkpoint from disk"
)
SKYRL_WITHOUT_EFFECT.update(
    {
        "generator.delta_weight_sync.checkpoint_load_format": ("vllm_multi_thread_safetensors", _RELOAD_ONLY),
        "generator.delta_weight_sync.multi_thread_safetensors_max_workers": (8, _RELOAD_ONLY),
    }
)

#: SkyRL keys that change what is trained and are not implemented: refused unless at their default.
SKYRL_NOT_IMPLEMENTED: dict[str, tuple[Any, str]] = {
    "trainer.sequence_parallel_backend": (
        "ulysses",
        "Ulysses is skylift's sequence parallelism (trainer.<model>.sequence_parallel_size)",
    ),
    "trainer.algorithm.use_entropy_loss": (False, "no entropy bonus in the policy loss"),
}


#: Keys only SkyRL's example entry points with a generator of their own read (Python skylift does
#: not run): refused with a message that says which example and why, not as unknown keys.
SKYRL_EXAMPLE_GENERATOR_KEYS: dict[str, str] = {
    # generator.miniswe_config_path / miniswe_traj_dir run on the gateway (skylift.compat.skyrl.keys)
    "generator.miniswe_*": "SkyRL's mini-SWE-agent example (examples/train/mini_swe_agent: its generator "
    "reads only miniswe_config_path and miniswe_traj_dir)",
    "generator.enable_child_agents": "SkyRL's RLM example (examples/train/rlm: its generator spawns child agents)",
    "generator.train_child_trajectories": "SkyRL's RLM example (examples/train/rlm: its generator spawns "
    "child agents)",
    "hydra.*": "SkyRL's terminal-bench example (examples/terminal_bench: Hydra config search path for its "
    "Harbor settings; it needs Docker sandboxes run by Harbor, which skylift does not provide)",
    "terminal_bench_config.*": "SkyRL's terminal-bench example (examples/terminal_bench: its generator runs "
    "each task in a Docker sandbox through Harbor, which skylift does not provide)",
}


def skyrl_example_generator(key: str) -> str | None:
    """Which SkyRL example generator reads `key` (see `SKYRL_EXAMPLE_GENERATOR_KEYS`), or None."""
    for pattern, example in SKYRL_EXAMPLE_GENERATOR_KEYS.items():
        if key == pattern or (pattern.endswith("*") and key.startswith(pattern[:-1])):
            return example
    return None


def skyrl_declaration(key: str) -> tuple[Any, str, bool] | None:
    """(SkyRL's default, reason, refused unless default) of a SkyRL key outside the schema, or None."""
    for table, refused in ((SKYRL_NOT_IMPLEMENTED, True), (SKYRL_WITHOUT_EFFECT, False)):
        if key in table:
            return (*table[key], refused)
        for pattern, entry in table.items():
            if pattern.endswith("*") and key.startswith(pattern[:-1]):
                return (*entry, refused)
    return None
