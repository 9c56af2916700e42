"""`generator.delta_weight_sync.*` (also ``generator.inference_engine.delta_weight_sync.*``): the
settings of checkpoint-delta weight sync (``weight_sync_backend=delta``, `skylift.weight_sync.delta.publish`
and `skylift.weight_sync.delta.apply`).

The policy's rank 0 writes each version's changed tensors, XORed with the version before and
compressed, under ``sync_dir``; every engine applies them to its own copy of the weights
(``local_checkpoint_dir``) and loads the changed tensors. The seed's keys that only its cloud transfers
or its whole-checkpoint reload read are declared without effect in ``skylift.config.inert``. A
``gs://`` or ``s3://`` sync_dir goes through ``skylift.weight_sync.delta.cloud``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from skylift.config.fields import _f

logger = logging.getLogger("skylift.config")

#: object-storage URI schemes a sync_dir may use (`skylift.weight_sync.delta.cloud`)
CLOUD_SCHEMES = ("gs://", "s3://")


@dataclass
class DeltaWeightSyncConfig:
    """Checkpoint-delta weight sync through a directory the trainer and the engines share."""

    sync_dir: str | None = _f(
        None,
        "weight_sync_backend=delta: where each policy version is published (deltas/delta-NNNNNNNN): "
        "a directory the policy's rank 0 and every engine share, or an s3:// or gs:// URI (needs "
        "s3fs / gcsfs); required with delta",
    )
    local_checkpoint_dir: str | None = _f(
        None,
        "engine side: directory of the engine host's patched copy of the weights (shared by the "
        "engines of one host, file-locked); null = a directory under the system's temp dir named "
        "after sync_dir",
    )
    publish_staging_dir: str | None = _f(
        None,
        "an s3:// or gs:// sync_dir: the local directory where rank 0 writes a version before "
        "uploading it (null = a temporary directory)",
    )
    cloud_download_workers: int = _f(
        4, "an s3:// or gs:// sync_dir: payload files each engine host downloads at once", ge=1, le=64
    )
    rebase_interval: int | None = _f(
        None,
        "skylift's: every N-th version is published against the base checkpoint (every tensor "
        "that differs from it: engines load it whole) and the versions before it are deleted, so "
        "sync_dir holds at most N versions; null = keep every version",
        ge=1,
    )
    max_file_size_in_gb: float = _f(1.0, "most compressed bytes of one payload file, in GiB", gt=0)
    publish_num_workers: int | None = _f(
        None, "threads that XOR and compress the changed tensors; null = min(8, CPU count)", ge=1
    )


def is_cloud_uri(path: str) -> bool:
    """Whether `path` names object storage (gs://, s3://) rather than a local directory."""
    return path.strip().lower().startswith(CLOUD_SCHEMES)


def delta_problems(backend: str, delta: DeltaWeightSyncConfig, lora_rank: int) -> list[str]:
    """What is wrong with the delta settings of a run whose weight sync backend is `backend`."""
    if backend != "delta":
        default = DeltaWeightSyncConfig()
        for f in fields(delta):
            if getattr(delta, f.name) != getattr(default, f.name):
                logger.warning(
                    "generator.delta_weight_sync.%s has no effect: weight_sync_backend=%s (not delta)",
                    f.name,
                    backend,
                )
        return []
    key = "generator.inference_engine.delta_weight_sync.sync_dir"
    if not delta.sync_dir or not delta.sync_dir.strip():
        return [f"{key} is required with weight_sync_backend=delta: the directory the trainer publishes to"]
    problems = []
    if not is_cloud_uri(delta.sync_dir):
        default = DeltaWeightSyncConfig()
        for name in ("publish_staging_dir", "cloud_download_workers"):
            if getattr(delta, name) != getattr(default, name):
                logger.warning(
                    "generator.delta_weight_sync.%s has no effect: sync_dir=%s is a directory (read "
                    "and written directly)",
                    name,
                    delta.sync_dir,
                )
    if lora_rank > 0:
        problems.append(
            "weight_sync_backend=delta does not support LoRA (trainer.policy.model.lora.rank > 0): "
            "a LoRA policy syncs its adapter; use weight_sync_backend=nccl (or auto)"
        )
    return problems
