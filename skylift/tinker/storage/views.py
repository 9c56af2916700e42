"""Tinker paths and the JSON shapes of stored records (as the SDK's `types` expect them)."""

from __future__ import annotations

import datetime as dt
import json
import re
from pathlib import Path
from typing import Any

from skylift.tinker.errors import UserError
from skylift.tinker.storage.meta import META_FILE
from skylift.tinker.storage.store import CheckpointRow, ModelRow

SCHEME = "tinker://"
KIND_SEGMENT = {"training": "weights", "sampler": "sampler_weights", "external": "external_weights"}
SEGMENT_KIND = {v: k for k, v in KIND_SEGMENT.items()}
_NAME = re.compile(r"[A-Za-z0-9._\-:=+@]+")
#: Longest checkpoint name or run id (a directory name on disk).
MAX_NAME_CHARS = 200


def _is_name(name: object) -> bool:
    return (
        isinstance(name, str)
        and len(name) <= MAX_NAME_CHARS
        and _NAME.fullmatch(name) is not None
        and name not in (".", "..")
    )


def check_name(name: str | None, what: str) -> str:
    """A checkpoint name: 1 to `MAX_NAME_CHARS` of letters, digits and . _ - : = + @; not `.`/`..`."""
    if not _is_name(name):
        shown = (
            name if not isinstance(name, str) or len(name) <= 80 else f"{name[:80]}... ({len(name)} chars)"
        )
        raise UserError(
            f"{what}: invalid checkpoint name {shown!r} (1 to {MAX_NAME_CHARS} letters, digits and "
            ". _ - : = + @; no '/')"
        )
    return name


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"{SCHEME}{model_id}/{KIND_SEGMENT[kind]}/{name}"


def run_dir(data_dir: Path, model_id: str, kind: str, name: str) -> Path:
    """Where checkpoint `name` of `kind` of run `model_id` lives under the server's `data_dir`."""
    return data_dir / "runs" / model_id / KIND_SEGMENT[kind] / name


def parse_tinker_path(path: str) -> tuple[str, str, str]:
    """(training run id, kind "training"|"sampler", name) of `tinker://<run>/<segment>/<name>`.

    The run id and the name must both pass as `check_name` names (no `/`, never `.` or `..`)."""
    if not isinstance(path, str) or not path.startswith(SCHEME):
        raise UserError(f"invalid checkpoint path {path!r}: expected tinker://<run id>/weights/<name>")
    parts = path[len(SCHEME) :].split("/")
    if len(parts) != 3 or parts[1] not in SEGMENT_KIND or not _is_name(parts[0]) or not _is_name(parts[2]):
        raise UserError(
            f"invalid checkpoint path {path!r}: expected "
            "tinker://<run id>/{weights|sampler_weights|external_weights}/<name>"
        )
    return parts[0], SEGMENT_KIND[parts[1]], parts[2]


def iso(t: dt.datetime | None) -> str | None:
    return None if t is None else t.replace(tzinfo=dt.UTC).isoformat().replace("+00:00", "Z")


def is_public(row: CheckpointRow) -> bool:
    """Published checkpoints carry ``"public": true`` in the metadata file beside their files."""
    meta = Path(row.directory) / META_FILE
    try:
        return bool(json.loads(meta.read_text()).get("public", False))
    except (OSError, ValueError):
        return False


def checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {
        "checkpoint_id": row.checkpoint_id,
        "checkpoint_type": row.kind,
        "time": iso(row.created_at),
        "tinker_path": row.tinker_path,
        "size_bytes": row.size_bytes,
        "public": is_public(row),
        "user_metadata": row.user_metadata,
        "expires_at": iso(row.expires_at),
    }


def training_run_json(row: ModelRow, checkpoints: list[CheckpointRow]) -> dict[str, Any]:
    config = row.config or {}
    rank = int(config.get("lora_rank", 0))
    last = {kind: next((c for c in checkpoints if c.kind == kind), None) for kind in ("training", "sampler")}
    return {
        "training_run_id": row.model_id,
        "base_model": row.base_model,
        "model_owner": "local",
        "is_lora": rank > 0,
        "corrupted": row.status == "failed",
        "lora_rank": rank if rank > 0 else None,
        "last_request_time": iso(row.last_request_time),
        "last_checkpoint": checkpoint_json(last["training"]) if last["training"] else None,
        "last_sampler_checkpoint": checkpoint_json(last["sampler"]) if last["sampler"] else None,
        "user_metadata": {str(k): str(v) for k, v in (row.user_metadata or {}).items()} or None,
    }
