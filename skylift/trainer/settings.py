"""What a run's parts are built from: directories, worker and optimizer settings, local engine
arguments and Ray's start-up. Pure functions of the configuration (Ray's start aside), so the
trainer reads as the loop it is.
"""

from __future__ import annotations

import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch

from skylift.config.errors import ConfigError
from skylift.config.schema import OptimizerConfig, SkyliftConfig
from skylift.inference.engine_args import lora_engine_args
from skylift.training.worker import OptimizerSettings, WorkerSettings

#: Environment variables the driver passes on to Ray workers and engines.
RAY_WORKER_ENV = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_CPU_KVCACHE_SPACE",
    "VLLM_HOST_IP",
    "GLOO_SOCKET_IFNAME",
    "SKYLIFT_CACHE_DIR",
    "TOKENIZERS_PARALLELISM",
    "OMP_NUM_THREADS",
    "VLLM_LOGGING_LEVEL",
    "TORCH_CPP_LOG_LEVEL",
    "TORCH_LOGS",
    "HF_HUB_DISABLE_PROGRESS_BARS",
    "PYTHONWARNINGS",
    "SKYLIFT_RUNS_DIR",
)


@dataclasses.dataclass
class RunPaths:
    root: Path
    ckpt: Path
    export: Path
    logs: Path

    @classmethod
    def from_config(cls, cfg: SkyliftConfig) -> RunPaths:
        from skylift.config.validation import default_run_root

        t = cfg.trainer
        root = default_run_root(t.run_name, t.runs_dir)
        return cls(
            root=root,
            ckpt=Path(t.ckpt_path).expanduser() if t.ckpt_path else root / "ckpts",
            export=Path(t.export_path).expanduser() if t.export_path else root / "exports",
            logs=Path(t.log_dir).expanduser() if t.log_dir else root / "logs",
        )


def max_generate_length(cfg: SkyliftConfig) -> int:
    g = cfg.generator
    return int(g.max_generate_length or g.sampling_params.max_generate_length)


def policy_optimizer_steps_per_step(cfg: SkyliftConfig) -> int:
    t = cfg.trainer
    return max(1, t.train_batch_size // t.policy_mini_batch_size) * t.update_epochs_per_batch


def optimizer_settings(o: OptimizerConfig, total_steps: int) -> OptimizerSettings:
    """A training worker's optimizer from the config (`total_steps`: its optimizer steps in the run)."""
    return OptimizerSettings(
        lr=o.lr,
        betas=(o.adam_betas[0], o.adam_betas[1]),
        weight_decay=o.weight_decay,
        max_grad_norm=o.max_grad_norm if o.max_grad_norm > 0 else math.inf,
        num_warmup_steps=o.num_warmup_steps,
        scheduler=o.scheduler,
        total_steps=total_steps,
    )


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
        lora_rank=lora.rank if trainable else 0,
        lora_alpha=lora.alpha,
        lora_target_modules=lora.target_modules,
        lora_dropout=lora.dropout,
        reshard_after_forward=fsdp.reshard_after_forward,
        cpu_offload=fsdp.cpu_offload,
        seed=t.seed,
        collective_timeout_s=t.collective_timeout_s,
        **micro_batch_settings(cfg),
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
    return WorkerSettings(
        model_path=t.critic.model.path or t.policy.model.path,
        head="value",
        compute_dtype="bfloat16" if t.bf16 else None,
        gradient_checkpointing=t.gradient_checkpointing,
        optimizer=optimizer_settings(t.critic.optimizer_config, total_steps * critic_steps),
        reshard_after_forward=t.critic.fsdp_config.reshard_after_forward,
        cpu_offload=t.critic.fsdp_config.cpu_offload,
        seed=t.seed,
        collective_timeout_s=t.collective_timeout_s,
        **micro_batch_settings(cfg),
    )


#: vLLM's CPU attention backend takes KV-cache blocks of a multiple of this many tokens only (its
#: engine dies at start-up with "No common block size" otherwise).
CPU_BLOCK_MULTIPLE = 32


def local_engine_kwargs(cfg: SkyliftConfig, sleep_mode: bool) -> dict[str, Any]:
    """`LocalVLLMEngine.create` arguments of the run's local engines."""
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
    # a LoRA policy: engines serve the base model plus the synced adapter (skylift.weight_sync.lora)
    kwargs.update(lora_engine_args(t.policy.model.lora.rank))
    kwargs.update(g.engine_init_kwargs)  # vLLM engine args as given (SkyRL's engine_init_kwargs)
    return kwargs


#: Settings that describe one host only: not passed on to the nodes of a joined cluster.
HOST_ONLY_ENV = ("VLLM_HOST_IP", "GLOO_SOCKET_IFNAME")


def ray_address(configured: str | None) -> str | None:
    """The cluster to join: `trainer.ray_address`, else `RAY_ADDRESS`, else None (start a local Ray)."""
    return configured or os.environ.get("RAY_ADDRESS") or None


def ray_worker_env(joining: bool) -> dict[str, str]:
    """Environment variables for Ray workers and engines (host-specific ones only on one host)."""
    env = {k: os.environ[k] for k in RAY_WORKER_ENV if k in os.environ}
    if joining:
        for key in HOST_ONLY_ENV:
            env.pop(key, None)
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # engine start-up chatter would drown the progress
    return env


def init_ray(address: str | None = None, min_cpus: float = 0, object_store_gb: float = 0.5) -> bool:
    """Join the Ray cluster at `address` (or `RAY_ADDRESS`), else start a local one on loopback.

    A local Ray gets at least `min_cpus` logical CPUs (what the run's placement groups ask for)
    and an object store of `object_store_gb` GiB.
    Returns True when this call connected (the caller then calls `ray.shutdown()`).
    """
    import ray

    if ray.is_initialized():
        return False
    address = ray_address(address)
    if address:
        # connecting: the cluster's nodes bring their own resources; none may be given here
        ray.init(address=address, log_to_driver=True, runtime_env={"env_vars": ray_worker_env(True)})
        return True
    ray.init(
        num_cpus=int(max(2, os.cpu_count() or 2, math.ceil(min_cpus))),
        include_dashboard=False,
        log_to_driver=True,
        object_store_memory=int(object_store_gb * (1 << 30)),
        runtime_env={"env_vars": ray_worker_env(False)},
        _node_ip_address="127.0.0.1",
    )
    return True


def ray_cluster_line(joined: bool) -> str:
    """What the connected Ray sees: `Ray cluster ADDR (joined): 2 node(s): 10.0.0.1 {CPU: 8, GPU: 4}, ...`."""
    import ray

    from skylift.trainer.placement import cluster_nodes, describe_cluster

    ctx = ray.get_runtime_context()
    gcs = getattr(ctx, "gcs_address", None) or "?"
    how = "joined" if joined else "started locally"
    return f"Ray cluster {gcs} ({how}): {describe_cluster(cluster_nodes())}"


@dataclasses.dataclass
class RayRun:
    """A run's Ray: whether this process connected (and must disconnect), its placement groups and
    what to tell the user about them."""

    started: bool
    placement: Any  # PlacedGroups
    lines: list[str]


def start_ray_run(cfg: SkyliftConfig) -> RayRun:
    """Join (or start) Ray and reserve the run's placement groups; the lines say which cluster was
    joined, what it has and where each group landed. Fails within `trainer.placement.timeout_s`
    when the cluster cannot hold the request (the message has both sides)."""
    import time

    import ray

    from skylift.trainer.placement import PlacedGroups, plan_placement, request_from_config

    started_at = time.perf_counter()
    address = ray_address(cfg.trainer.ray_address)
    gpu = torch.cuda.is_available()
    request = request_from_config(cfg, gpu=gpu)
    plan = plan_placement(request)
    started = init_ray(
        address, min_cpus=plan.total().get("CPU", 0.0), object_store_gb=cfg.trainer.ray_object_store_gb
    )
    lines = [ray_cluster_line(joined=bool(address))]
    needed, have = plan.total().get("GPU", 0.0), float(ray.cluster_resources().get("GPU", 0.0))
    if not address and 0 < have < needed:
        # one machine with fewer GPUs than bundles: they share its GPUs, as actors without
        # placement groups did (a cluster that is short of GPUs fails below instead)
        share = have / needed
        plan = plan_placement(dataclasses.replace(request, gpus_per_bundle=share))
        lines.append(
            f"{needed:g} GPU bundles on this machine's {have:g} GPU(s): each bundle gets {share:.2f} GPU"
        )
    try:
        placement = PlacedGroups(plan, cfg.trainer.placement.timeout_s)
    except BaseException:
        if started:
            ray.shutdown()
        raise
    lines.append(
        f"placement: {placement.layout()} (ready in {time.perf_counter() - started_at:.1f} s with Ray start-up)"
    )
    return RayRun(started=started, placement=placement, lines=lines)


def lora_sync_path(cfg: SkyliftConfig) -> str | None:
    """The directory a LoRA policy's syncs hand the adapter over through (None: in memory):
    `generator.lora_sync_path`, or SkyRL's `trainer.policy.model.lora.lora_sync_path` (validation
    refuses the two naming different directories)."""
    return cfg.generator.lora_sync_path or cfg.trainer.policy.model.lora.lora_sync_path or None
