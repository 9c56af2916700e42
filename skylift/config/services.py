"""Typed settings of the two servers, beside the training run's tree (``schema.py``).

`ServerConfig` / `EngineSettings`: a Tinker server (``skylift tinker serve`` fills them from its
flags). `InferenceServerSettings`: what skylift's own code of an inference server (``skylift
serve``) reads, built once from vLLM's parsed flags (the command line stays vLLM's). Its
`InferenceServerLimits`: what one request may ask and how long its weight RPCs may take, read once
from the environment (``SKYLIFT_MAX_N``, ``SKYLIFT_MAX_PROMPTS``, ``SKYLIFT_MAX_SEQUENCES``,
``SKYLIFT_MAX_REQUEST_TOKENS``, ``SKYLIFT_WEIGHT_RPC_TIMEOUT_S``;
every ``SKYLIFT_*`` variable is listed in ``environment.py``), as vLLM's own ``VLLM_*`` tuning
variables are read.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: how a Tinker sampling engine serves LoRA samplers (``--sampler-lora``, skylift.tinker.sampling.lora_mode)
LORA_MODES = ("auto", "adapters", "swap")


@dataclass
class EngineSettings:
    """How a Tinker server builds its sampling engines."""

    max_model_len: int = 2048
    dtype: str = "float32"
    max_num_seqs: int = 64
    seed: int = 0
    start_timeout_s: float = 900.0
    # LoRA samplers: adapters in the batch, weight swaps, or measured per engine (skylift.tinker.sampling.lora_mode)
    lora_mode: str = "auto"
    max_lora_rank: int = 32  # a LoRA sampler of a higher rank takes the swap path
    max_loras: int = 4  # adapters in one batch (vLLM's max_loras)
    lora_slots: int = 8  # adapters an engine holds at once, least recently used evicted (max_cpu_loras)
    # vLLM's share of the GPU per engine (None: vLLM's default); the server sets what its training
    # budget leaves (skylift.tinker.training.admission.sampling_engine_fraction)
    gpu_memory_utilization: float | None = None


@dataclass
class ServerConfig:
    """Settings of one Tinker server."""

    base_models: list[str]
    db_url: str = "sqlite:///skylift-tinker.db"
    data_dir: Path = Path("skylift-tinker-data")
    api_key: str | None = None
    api_keys_file: Path | None = None  # "USER KEY" lines; SIGHUP reloads it (skylift.tinker.core.auth)
    result_retention_s: float | None = 3600.0  # retrieved results are deleted this long after
    max_model_len: int | None = None  # default: the model's, capped at 4096
    session_timeout_s: float = 300.0
    cleanup_interval_s: float = 30.0
    long_poll_s: float = 20.0
    gap_timeout_s: float = 2.0
    micro_batch_size: int = 8
    # ephemeral sampler snapshots: all of them within this memory (those of live sessions are never
    # dropped), at most `max_idle_snapshots` of finished sessions kept
    snapshot_memory_mb: float = 8192.0
    max_idle_snapshots: int = 4
    engine: EngineSettings = field(default_factory=EngineSettings)
    # what one request may ask (skylift.tinker.core.limits; docs/security.md)
    allowed_local_media_paths: list[Path] = field(default_factory=list)  # image pointer roots; none: refused
    max_request_mb: float = 256.0  # a request body, before and after zstd decompression
    max_request_cells: int = 16 * 1024 * 1024  # loss-input cells of one forward(_backward), padded
    future_max_age_s: float = 86400.0  # a future never retrieved is deleted this long after it was made
    # fair sharing between users (skylift.tinker.core.fairness; docs/serving_limits.md)
    fair_wait_timeout_s: float = 600.0  # longest wait for a turn on the training thread or an engine
    sampling_slots: int = 4  # sample requests one engine serves at once; the rest wait their user's turn
    # per-user quotas
    max_pending_per_user: int = 1024  # futures of one user pending (queued or running) at once
    max_snapshot_mb_per_user: float = 4096.0  # memory of the sampler snapshots one user's live sessions hold
    max_record_tokens_per_user: int = 5_000_000  # stability-record tokens of one user (oldest dropped)
    max_checkpoint_gb_per_user: float = 1024.0  # checkpoint disk of one user
    # training admission (skylift.tinker.training.admission): the memory training clients may hold (None: a
    # fraction of the training device's), live training clients and LoRA adapters per user (the
    # users file may set a user's own)
    training_memory_gb: float | None = None
    max_clients_per_user: int = 64
    max_adapters_per_user: int = 64


@dataclass(frozen=True)
class InferenceServerLimits:
    """Limits of one inference request and timeouts of the engine's control RPCs."""

    max_n: int = 256  # samples per prompt (SKYLIFT_MAX_N)
    max_prompts: int = 4096  # prompts in one /skylift/generate request (SKYLIFT_MAX_PROMPTS)
    max_sequences: int = 16384  # prompts x n in one /skylift/generate request (SKYLIFT_MAX_SEQUENCES)
    # prompts x n x max_tokens in one /skylift/generate request (SKYLIFT_MAX_REQUEST_TOKENS)
    max_request_tokens: int = 1 << 25
    # bytes of one body of vLLM's /inference/v1/generate (SKYLIFT_MAX_GENERATE_BODY_MB)
    max_generate_body_mb: float = 32.0
    weight_rpc_timeout_s: float = 600.0  # one weight-bucket receive (SKYLIFT_WEIGHT_RPC_TIMEOUT_S)
    control_rpc_timeout_s: float = 60.0  # small control RPCs (destroy, has-group)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> InferenceServerLimits:
        """The defaults, overridden by the variables that are set (a bad value names its variable)."""
        default = cls()
        return cls(
            max_n=int(_number(environ, "SKYLIFT_MAX_N", default.max_n, minimum=1)),
            max_prompts=int(_number(environ, "SKYLIFT_MAX_PROMPTS", default.max_prompts, minimum=1)),
            max_sequences=int(_number(environ, "SKYLIFT_MAX_SEQUENCES", default.max_sequences, minimum=1)),
            max_request_tokens=int(
                _number(environ, "SKYLIFT_MAX_REQUEST_TOKENS", default.max_request_tokens, minimum=1)
            ),
            max_generate_body_mb=_number(
                environ, "SKYLIFT_MAX_GENERATE_BODY_MB", default.max_generate_body_mb, minimum=1
            ),
            weight_rpc_timeout_s=_number(
                environ, "SKYLIFT_WEIGHT_RPC_TIMEOUT_S", default.weight_rpc_timeout_s
            ),
        )


@dataclass(frozen=True)
class InferenceServerSettings:
    """One `skylift serve` process, as skylift's routes and checks see it."""

    model_path: str  # --model, resolved (a registry name becomes its local directory)
    model_name: str  # the served name: the first --served-model-name, else --model
    host: str | None = None  # --host ("" or None: every interface)
    uds: str | None = None  # --uds (a Unix socket instead of host and port)
    api_keys: tuple[str, ...] = ()  # --api-key (repeatable), else $VLLM_API_KEY
    limits: InferenceServerLimits = field(default_factory=InferenceServerLimits)

    @classmethod
    def from_args(
        cls,
        args: Any,
        environ: Mapping[str, str] = os.environ,
        limits: InferenceServerLimits | None = None,
    ) -> InferenceServerSettings:
        """From vLLM's parsed server flags (after skylift's conventions are applied to them);
        `limits` default: read from `environ`."""
        keys = tuple(k for k in (args.api_key or [environ.get("VLLM_API_KEY")]) if k)
        return cls(
            model_path=str(args.model),
            model_name=str((args.served_model_name or [args.model])[0]),
            host=args.host,
            uds=getattr(args, "uds", None),
            api_keys=keys,
            limits=limits if limits is not None else InferenceServerLimits.from_env(environ),
        )


def _number(environ: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = environ.get(name, "")
    try:
        value = float(raw) if raw else default
    except ValueError as e:
        raise ValueError(f"{name} must be a number, got {raw!r}") from e
    if value < minimum or (minimum == 0.0 and value <= 0):
        raise ValueError(f"{name} must be {'> 0' if minimum == 0.0 else f'>= {minimum:g}'}, got {raw!r}")
    return value
