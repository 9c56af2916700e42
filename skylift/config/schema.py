"""The configuration schema: a tree of dataclasses with the seed's key names (the ``data`` and
``environment`` groups are in ``inputs.py``, ``trainer.algorithm`` in ``algorithm.py``).

Every field carries a one-line help text in its metadata (``field(metadata={"help": ...})``); it is
what ``format_config(cfg, with_help=True)`` and ``skylift train --help`` print. A field's own
constraint sits beside it (``_f(8, "...", ge=1)``: see ``skylift.config.fields.Bounds``);
checks that involve several keys are in ``skylift.config.validation``. Fields whose default
is ``None`` and whose help says "null = ..." get a derived value from ``load_config`` (see
``skylift.config.validation.finalize``). Build a validated tree with ``skylift.config.load_config``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skylift.config.algorithm import AlgorithmConfig
from skylift.config.delta_sync import DeltaWeightSyncConfig
from skylift.config.fields import _f, _group
from skylift.config.fully_async import FullyAsyncConfig
from skylift.config.inputs import DataConfig, EnvironmentConfig
from skylift.config.records import RolloutRecordsConfig, TorchProfilerConfig
from skylift.config.sampling import EvalSamplingConfig, SamplingConfig

DEFAULT_POLICY_MODEL = "smollm2-135m-instruct"

RESUME_MODES = ("none", "latest", "from_path")
LOGGERS = ("console", "jsonl", "tensorboard", "wandb", "mlflow")
STRATEGIES = ("fsdp2", "fsdp")
INFERENCE_BACKENDS = ("vllm",)
WEIGHT_SYNC_BACKENDS = ("auto", "nccl", "gloo", "ipc", "delta")
MODEL_DTYPES = ("float32", "bfloat16", "float16", "auto")
UPDATE_GROUP_OVERRIDES = ("auto", "enable", "disable")
PLACEMENT_BACKENDS = ("auto", "ray", "local")
LR_SCHEDULERS = ("constant", "constant_with_warmup", "linear", "cosine")


# ------------------------------------------------------------------------------------------ trainer


@dataclass
class AdapterConfig:
    """LoRA adapters on a trained model (rank 0 trains all weights)."""

    rank: int = _f(0, "LoRA rank; 0 disables LoRA and trains the full model", ge=0)
    alpha: int = _f(16, "LoRA scaling numerator (scale = alpha / rank)")
    dropout: float = _f(0.0, "dropout on the LoRA input", ge=0, lt=1)
    target_modules: str | list[str] = _f(
        "all-linear", "modules that get adapters: 'all-linear' or a list of names"
    )


@dataclass
class LoraConfig(AdapterConfig):
    """LoRA adapters on the policy (rank 0 trains all weights)."""

    lora_sync_path: str | None = _f(
        None,
        "another name of generator.lora_sync_path (the same effect; set both only to the same "
        "directory): directory through which each sync hands the adapter to the engines",
    )


@dataclass
class ModelWeightsConfig:
    """Which weights a worker loads."""

    path: str | None = _f(
        None, "model: registry name (tiny-qwen2, smollm2-135m-instruct), local directory or Hub id"
    )


@dataclass
class PolicyModelConfig(ModelWeightsConfig):
    """The policy's weights, optionally trained through LoRA adapters."""

    path: str | None = _f(
        DEFAULT_POLICY_MODEL,
        "model: registry name (tiny-qwen2, smollm2-135m-instruct), local directory or Hub id",
    )
    lora: LoraConfig = _group(LoraConfig, "LoRA settings")


@dataclass
class CriticModelConfig(ModelWeightsConfig):
    """The critic's weights, optionally trained through LoRA adapters (its value head in full)."""

    lora: AdapterConfig = _group(AdapterConfig, "critic LoRA settings (the value head trains in full)")


@dataclass
class OptimizerConfig:
    """AdamW and learning-rate schedule of one trained model."""

    lr: float = _f(1.0e-6, "AdamW learning rate", gt=0)
    adam_betas: list[float] = _f([0.9, 0.999], "AdamW betas [beta1, beta2]")
    weight_decay: float = _f(1.0e-2, "AdamW decoupled weight decay", ge=0)
    max_grad_norm: float = _f(1.0, "clip the global gradient norm to this value; <= 0 disables clipping")
    num_warmup_steps: int = _f(0, "linear warm-up steps of the learning rate", ge=0)
    scheduler: str = _f(
        "constant_with_warmup", f"learning-rate schedule: {' | '.join(LR_SCHEDULERS)}", choices=LR_SCHEDULERS
    )
    offload_after_step: bool = _f(
        True, "colocate_all on GPUs: optimizer state in host memory while engines are awake (weights: always)"
    )


@dataclass
class FSDPConfig:
    """PyTorch FSDP2 (fully_shard) settings of one model."""

    cpu_offload: bool = _f(
        False, "sharded GPU workers keep parameters, gradients and optimizer state in host memory"
    )
    reshard_after_forward: bool = _f(
        True, "sharded workers free gathered layers after forward (false: keep them until backward)"
    )
    fsdp_size: int = _f(
        -1,
        "hybrid sharding: shard over groups of this many ranks and replicate across the groups "
        "(-1 or >= the group's ranks: shard over all)",
    )


@dataclass
class PolicyConfig:
    """The trained policy."""

    model: PolicyModelConfig = _group(PolicyModelConfig, "policy weights")
    optimizer_config: OptimizerConfig = _group(OptimizerConfig, "policy optimizer")
    fsdp_config: FSDPConfig = _group(FSDPConfig, "policy FSDP2 settings")
    sequence_parallel_size: int = _f(
        1, "Ulysses sequence parallelism: groups of this many workers split each sequence", ge=1
    )
    torch_profiler_config: TorchProfilerConfig = _group(TorchProfilerConfig, "torch.profiler traces")


@dataclass
class RefConfig:
    """The frozen reference model used for the KL term."""

    model: ModelWeightsConfig = _group(
        ModelWeightsConfig, "reference weights; path null = same as the policy's"
    )
    fsdp_config: FSDPConfig = _group(FSDPConfig, "reference FSDP2 settings", cpu_offload=True)
    sequence_parallel_size: int = _f(
        1, "Ulysses sequence parallelism: groups of this many workers split each sequence", ge=1
    )


@dataclass
class CriticConfig:
    """The value model (used by the gae advantage estimator)."""

    model: CriticModelConfig = _group(
        CriticModelConfig,
        "critic weights; path null = no critic, or the policy's weights when advantage_estimator=gae",
    )
    optimizer_config: OptimizerConfig = _group(OptimizerConfig, "critic optimizer", lr=5.0e-6)
    fsdp_config: FSDPConfig = _group(FSDPConfig, "critic FSDP2 settings")
    sequence_parallel_size: int = _f(
        1, "Ulysses sequence parallelism: groups of this many workers split each sequence", ge=1
    )


@dataclass
class PlacementConfig:
    """Where the workers run (on a CPU-only machine, 'gpus' count CPU worker processes)."""

    colocate_all: bool = _f(
        False,
        "share the same devices between training workers and inference engines (engines sleep while training)",
    )
    colocate_policy_ref: bool = _f(True, "put policy and reference workers on the same devices")
    backend: str = _f(
        "auto",
        f"{' | '.join(PLACEMENT_BACKENDS)}: ray = workers and local engines are Ray actors; local = all in this "
        "process (one policy, one reference worker); auto = ray when Ray is needed (several workers or "
        "local engines), else local",
    )
    policy_num_nodes: int = _f(1, "nodes for policy workers")
    policy_num_gpus_per_node: int = _f(1, "policy workers (GPUs, or CPU processes) per node")
    ref_num_nodes: int = _f(1, "nodes for reference workers")
    ref_num_gpus_per_node: int = _f(1, "reference workers (GPUs, or CPU processes) per node")
    critic_num_nodes: int = _f(1, "nodes for critic workers")
    critic_num_gpus_per_node: int = _f(1, "critic workers (GPUs, or CPU processes) per node")
    # several machines (issue 15): bundle sizes on CPU clusters and how long to wait for them
    num_cpus_per_worker: float = _f(
        1.0, "CPUs in each placement bundle (one per worker or engine rank; on GPU nodes beside its GPU)"
    )
    timeout_s: float = _f(
        120.0, "the longest the placement groups may wait for resources before the run fails saying why"
    )


@dataclass
class TrainerConfig:
    """The RL loop: models, placement, batch sizes, evaluation, checkpoints and logging."""

    placement: PlacementConfig = _group(PlacementConfig, "worker placement")
    # several machines (issue 15): join a running Ray cluster instead of starting one
    ray_address: str | None = _f(
        None, "Ray cluster to join (e.g. 10.0.0.1:6379 or auto); null = RAY_ADDRESS if set, else a local Ray"
    )
    strategy: str = _f(  # accepted without effect: see skylift.config.inert
        "fsdp2",
        f"accepted for compatibility, no effect in skylift (only {' | '.join(STRATEGIES)}; fsdp means FSDP2)",
        choices=STRATEGIES,
    )
    policy: PolicyConfig = _group(PolicyConfig, "trained policy")
    ref: RefConfig = _group(RefConfig, "reference model")
    critic: CriticConfig = _group(CriticConfig, "value model")
    algorithm: AlgorithmConfig = _group(AlgorithmConfig, "RL algorithm")
    gradient_checkpointing: bool = _f(True, "recompute activations in backward to save memory")
    bf16: bool = _f(
        False,
        "mixed precision: bfloat16 matmuls (torch.autocast) over float32 weights and optimizer "
        "state (false = all float32); default true on GPUs (skylift.config.device_defaults)",
    )
    seed: int = _f(42, "random seed for data order, sampling and initialisation")
    epochs: int = _f(1, "passes over the training data", ge=1)
    max_steps: int | None = _f(None, "stop after this many training steps; null = run all epochs", ge=1)
    update_epochs_per_batch: int = _f(1, "gradient passes over each training batch", ge=1)
    train_batch_size: int = _f(8, "prompts per training step (each sampled n_samples_per_prompt times)", ge=1)
    policy_mini_batch_size: int = _f(8, "prompts per policy optimizer step; divides train_batch_size", ge=1)
    critic_mini_batch_size: int = _f(8, "prompts per critic optimizer step; divides train_batch_size", ge=1)
    skip_zero_advantage_rows: bool = _f(
        True,
        "train the policy only on rows with a non-zero advantage (their update is exactly the same: "
        "the others have zero gradient); ignored with a KL loss",
    )
    worker_timeout_s: float = _f(
        3600.0,
        "the longest one call to a training worker may take (a mini-batch, a checkpoint) before the "
        "run fails naming the worker, its rank and the call",
        gt=0,
    )
    collective_timeout_s: float = _f(
        600.0, "timeout of the training ranks' rendezvous and of each collective between them", gt=0
    )
    micro_train_batch_size_per_gpu: int = _f(4, "sequences per forward/backward pass on one worker", ge=1)
    micro_forward_batch_size_per_gpu: int = _f(
        8, "sequences per forward-only pass (logprobs, values) on one worker", ge=1
    )
    max_tokens_per_microbatch: int = _f(
        -1,
        "micro-batches by a token budget instead of the two row counts above (forward and training "
        "passes of policy, reference and critic): real tokens with remove_microbatch_padding, padded "
        "cells (rows x width) without; a longer sequence gets a micro-batch of its own; -1 = off",
        or_minus_one="for row counts",
    )
    remove_microbatch_padding: bool = _f(
        False,
        "padding-free: pack each micro-batch's sequences into one row (position ids restart per "
        "sequence; transformers builds the block-diagonal mask)",
    )
    share_prefixes: bool = _f(
        False,
        "prefix sharing: each micro-batch as one row holding every distinct token prefix once (a "
        "shared prompt or system message, identical samples), with a tree attention mask; same "
        "numbers as the padded passes; sdpa or eager attention only; wins over remove_microbatch_padding",
    )
    max_prompt_length: int = _f(512, "longest prompt in tokens; longer prompts are dropped from data", ge=1)
    eval_batch_size: int = _f(64, "prompts per evaluation generation batch", ge=1)
    eval_before_train: bool = _f(True, "evaluate once before the first training step")
    eval_interval: int = _f(5, "evaluate every N steps; -1 or 0 disables", ge=-1)
    ckpt_path: str | None = _f(None, "resumable checkpoints directory; null = <runs_dir>/<run_name>/ckpts")
    ckpt_interval: int = _f(
        10, "save a resumable checkpoint every N steps; -1 disables", or_minus_one="to disable"
    )
    max_ckpts_to_keep: int = _f(
        -1, "keep only the newest N checkpoints; -1 keeps all", or_minus_one="to keep all"
    )
    hf_save_interval: int = _f(
        -1, "export Hugging Face weights every N steps; -1 = only at the end", or_minus_one="to disable"
    )
    export_path: str | None = _f(
        None, "Hugging Face exports directory; null = ~/skylift/runs/<run_name>/exports"
    )
    resume_mode: str | None = _f(
        "latest", f"resume: {' | '.join(RESUME_MODES)} (null = none)", choices=RESUME_MODES
    )
    resume_path: str | None = _f(None, "checkpoint directory to resume from when resume_mode=from_path")
    logger: str | list[str] = _f(
        "console", f"metric trackers: one of {' | '.join(LOGGERS)} or a list of them", choices=LOGGERS
    )
    log_dir: str | None = _f(
        None, "metrics (jsonl, tensorboard) and plots; null = ~/skylift/runs/<run_name>/logs"
    )
    project_name: str = _f("skylift", "project name for trackers")
    run_name: str = _f("skylift_run", "run name for trackers and output directories (empty: skylift_run's)")
    runs_dir: str | None = _f(
        None,
        "default output directories are <runs_dir>/<run_name>/...; null = $SKYLIFT_RUNS_DIR or ~/skylift/runs",
    )
    ray_object_store_gb: float = _f(
        0.5, "object store of the Ray instance a run starts (not one it joins)", gt=0
    )
    async_training: bool = _f(
        False,
        "one-step-off: generate step t+1's rollouts while step t trains (rollout logprobs become the PPO "
        "ratio's old logprobs; with algorithm.use_tis the trainer's are, and TIS corrects the gap)",
    )
    max_staleness_steps: int = _f(
        1,
        "async_training: most policy updates between sampling a rollout and training on it; above 1, "
        "weight syncs are skipped while this bound allows",
        ge=1,
    )
    fully_async: FullyAsyncConfig = _group(
        FullyAsyncConfig, "fully asynchronous training (in-flight weight updates)"
    )
    dump_eval_results: bool = _f(True, "write evaluation samples and scores to log_dir")
    rollout_records: RolloutRecordsConfig = _group(RolloutRecordsConfig, "samples for skylift view")
    dump_data_batch: bool = _f(
        False,
        "write each step's training batch to <export_path>/dumped_data/global_step_N_training_input.pkl",
    )
    log_path: str | None = _f(
        None, "also write skylift's log messages (INFO and up) to <log_path>/infra-<time>.log; null = off"
    )

    def loggers(self) -> list[str]:
        """The configured trackers as a list (``logger`` may be one name or a list)."""
        return [self.logger] if isinstance(self.logger, str) else list(self.logger)

    def policy_world_size(self) -> int:
        """Number of policy workers."""
        return self.placement.policy_num_nodes * self.placement.policy_num_gpus_per_node


# ---------------------------------------------------------------------------------------- generator


@dataclass
class GeneratorConfig:
    """Rollouts: inference engines (local or remote) and sampling."""

    backend: str = _f(  # accepted without effect: see skylift.config.inert
        "vllm",
        f"accepted for compatibility, no effect in skylift (only {' | '.join(INFERENCE_BACKENDS)})",
        choices=INFERENCE_BACKENDS,
    )
    run_engines_locally: bool = _f(
        True, "start engines as Ray actors (true) or use remote_inference_engine_urls"
    )
    remote_inference_engine_urls: list[str] = _f(
        ["127.0.0.1:8001"], "host:port of running skylift/vLLM servers (when run_engines_locally=false)"
    )
    override_existing_update_group: str = _f(
        "auto",
        "replace an existing weight-update group on the servers: auto | enable | disable (true/false ok)",
        choices=UPDATE_GROUP_OVERRIDES,
    )
    seeded_sampling: bool = _f(
        True,
        "sample each prompt with a seed made of trainer.seed, the step and the prompt's place in "
        "the batch: runs repeat exactly, and a resumed run samples what an uninterrupted one would",
    )
    num_inference_engines: int = _f(1, "number of local engines", ge=1)
    inference_engine_tensor_parallel_size: int = _f(1, "tensor-parallel size of each local engine", ge=1)
    model_dtype: str = _f(
        "float32",
        f"engine weight dtype: {' | '.join(MODEL_DTYPES)}; should match training (default bfloat16 on GPUs)",
        choices=MODEL_DTYPES,
    )
    weight_sync_backend: str = _f(
        "auto",
        f"weight sync: {' | '.join(WEIGHT_SYNC_BACKENDS)} (auto: CUDA IPC on a shared GPU, nccl between "
        "GPUs, shared memory on one CPU host where /dev/shm has room, else gloo; delta: delta_weight_sync)",
        choices=WEIGHT_SYNC_BACKENDS,
    )
    gpu_memory_utilization: float = _f(0.8, "fraction of device memory a local engine may use", gt=0, le=1)
    kv_cache_gb: float | None = _f(
        None,
        "KV cache of each local engine in GiB (CPU default: the model's need, 32 MiB-1 GiB; GPU: memory share)",
        gt=0,
    )
    max_num_seqs: int = _f(256, "most sequences a local engine batches at once", ge=1)
    max_num_batched_tokens: int = _f(8192, "most tokens a local engine processes per scheduler step", ge=1)
    enable_prefix_caching: bool = _f(True, "reuse KV cache of shared prompt prefixes")
    kv_cache_block_size: int | None = _f(
        None,
        "tokens per KV-cache block of a local engine (vLLM's block_size): prefix caching reuses whole "
        "blocks only, so prompts that share fewer tokens than a block share nothing; null = vLLM's "
        "default (128 on CPU, 16 on GPU); a multiple of 32 on CPU",
        ge=1,
    )
    enable_chunked_prefill: bool = _f(True, "split long prefills into chunks")
    enforce_eager: bool = _f(True, "disable CUDA graphs in local engines (default false on GPUs)")
    async_engine: bool = _f(  # accepted without effect: see skylift.config.inert
        True,
        "accepted for compatibility, no effect in skylift (engines always run vLLM's async engine)",
    )
    batched: bool = _f(True, "single-turn: send the whole batch at once (false = agent loop per trajectory)")
    max_turns: int = _f(1, "most assistant turns per trajectory (> 1 = multi-turn agent loop)", ge=1)
    max_input_length: int | None = _f(
        None, "multi-turn: most tokens of context; null = trainer.max_prompt_length", ge=1
    )
    use_conversation_multi_turn: bool = _f(
        True, "multi-turn: observations as chat messages (false = their text continues the assistant turn)"
    )
    chat_template_kwargs: dict[str, Any] = _f(
        {},
        "extra arguments of every apply_chat_template call, e.g. generator.chat_template_kwargs.enable_thinking=false",
    )
    append_eos_token_after_stop_str_in_multi_turn: bool = _f(
        True,
        "multi-turn: a turn that stopped on a stop string gets the template's end-of-turn tokens (EOS) "
        "before the next observation, untrained (false = the observation follows the stop string)",
    )
    step_wise_trajectories: bool = _f(
        False,
        "multi-turn: each turn its own sample (prompt: the conversation as rendered for that turn), "
        "sharing the rollout's advantage; for templates that rewrite earlier turns (Qwen3 thinking); "
        "needs a sequence-level advantage estimator (grpo, rloo)",
    )
    merge_stepwise_output: bool = _f(
        False, "step-wise: merge a rollout's steps that extend the one before into one sample"
    )
    on_template_mismatch: str = _f("error", "history change: error|step_wise", choices=("error", "step_wise"))
    vision_language_generator: bool = _f(False, "true: the policy must be a vision-language model")
    enable_return_routed_experts: bool = _f(
        False,
        "routing replay (R3) of a mixture-of-experts policy: engines return each token's routed experts "
        "and the trainer's forwards (old, new, reference logprobs) route every token to them; needs prefix caching",
    )
    n_samples_per_prompt: int = _f(4, "responses sampled per training prompt (the GRPO group size)", ge=1)
    max_generate_length: int | None = _f(
        None, "shorthand for sampling_params.max_generate_length; when set it wins over it", ge=1
    )
    sampling_params: SamplingConfig = _group(SamplingConfig, "sampling for training rollouts")
    eval_sampling_params: EvalSamplingConfig = _group(EvalSamplingConfig, "sampling for evaluation")
    eval_n_samples_per_prompt: int = _f(1, "responses sampled per evaluation prompt", ge=1)
    zero_reward_on_non_stop: bool = _f(
        False, "reward 0 for responses that did not end with a stop (truncated)"
    )
    apply_overlong_filtering: bool = _f(
        False, "mask the loss of truncated responses (DAPO overlong filtering)"
    )
    http_timeout_s: float = _f(
        300.0,
        "timeout in seconds of one engine request (HTTP to a remote engine, or a local engine call)",
        gt=0,
    )
    engine_startup_timeout_s: float = _f(900.0, "the longest local engines may take to start", gt=0)
    # several machines (issue 15): where the weight-update group's store listens
    weight_sync_master_address: str | None = _f(
        None,
        "address the engines dial for weight sync; null = the policy rank 0 node's IP (local engines) "
        "or this host's address on the route to the first remote engine",
    )
    weight_sync_timeout_s: float = _f(
        300.0, "timeout of the weight-update group's rendezvous and of each weight broadcast", gt=0
    )
    delta_weight_sync: DeltaWeightSyncConfig = _group(DeltaWeightSyncConfig, "weight_sync_backend=delta")
    engine_init_kwargs: dict[str, Any] = _f(
        {}, "extra keyword arguments for each local vLLM engine (vLLM's engine args, e.g. max_model_len)"
    )
    lora_sync_path: str | None = _f(
        None,
        "LoRA policy (trainer.policy.model.lora.rank > 0): directory, readable by every engine, through "
        "which each sync hands the adapter over (/v1/load_lora_adapter); null = in memory over the "
        "weight-update group",
    )


# ---------------------------------------------------------------------------------------------- root


@dataclass
class SkyliftConfig:
    """Root of the configuration tree."""

    data: DataConfig = _group(DataConfig, "prompt data")
    trainer: TrainerConfig = _group(TrainerConfig, "RL trainer")
    generator: GeneratorConfig = _group(GeneratorConfig, "rollout generation")
    environment: EnvironmentConfig = _group(EnvironmentConfig, "reward environments")
