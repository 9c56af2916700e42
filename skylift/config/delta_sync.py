"""`generator.delta_weight_sync.*` (SkyRL: ``generator.inference_engine.delta_weight_sync.*``): the
settings of checkpoint-delta weight sync (``weight_sync_backend=delta``, `skylift.weight_sync.delta_publish`
and `skylift.weight_sync.delta_apply`).

The policy's rank 0 writes each version's changed tensors, XORed with the version before and
compressed, under ``sync_dir``; every engine applies them to its own copy of the weights
(``local_checkpoint_dir``) and loads the changed tensors. SkyRL's keys that only its cloud transfers
or its whole-checkpoint reload read are declared without effect in ``skylift.config.inert``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, fields

from skylift.config.fields import _f

logger = logging.getLogger("skylift.config")

#: URI schemes SkyRL's delta sync writes to and skylift does not (yet)
CLOUD_SCHEMES = ("gs://", "s3://")


@dataclass
class DeltaWeightSyncConfig:
    """Checkpoint-delta weight sync through a directory the trainer and the engines share."""

    sync_dir: str | None = _f(
        None,
        "weight_sync_backend=delta: directory, shared by the policy's rank 0 and every engine, where "
        "each policy version is published (deltas/delta-NNNNNNNN); required with delta; gs:// and "
        "s3:// are not supported yet",
    )
    local_checkpoint_dir: str | None = _f(
        None,
        "engine side: directory of the engine host's patched copy of the weights (shared by the "
        "engines of one host, file-locked); null = a directory under the system's temp dir named "
        "after sync_dir",
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
    if is_cloud_uri(delta.sync_dir):
        problems.append(
            f"{key}={delta.sync_dir!r}: gs:// and s3:// sync dirs are not supported by skylift yet "
            "(no cloud upload or download is written): give a directory that the policy's rank 0 "
            "and every engine can reach, e.g. on a shared filesystem"
        )
    if lora_rank > 0:
        problems.append(
            "weight_sync_backend=delta does not support LoRA (trainer.policy.model.lora.rank > 0), as "
            "in SkyRL: a LoRA policy syncs its adapter; use weight_sync_backend=nccl (or auto)"
        )
    return problems
