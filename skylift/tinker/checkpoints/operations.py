"""Checkpoints out and in: external weights with signed download URLs, publish/unpublish, TTLs,
copies, weights info, and the session views `tinker` CLI commands read.

``save_weights_external`` writes a Hugging Face model directory (merged weights, config, tokenizer:
`transformers.AutoModelForCausalLM.from_pretrained` loads it) as
``tinker://<run>/external_weights/<name>``. ``external_weights_urls`` signs one URL per file,
served by this server under ``/signed/...`` (no API key: the HMAC signature and its expiry are
the credential, so plain downloaders such as `tinker checkpoint download` work unmodified).
"""

from __future__ import annotations

import datetime as dt
import hashlib
import hmac
import json
import secrets
import shutil
import time
import urllib.parse
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from skylift.tinker.checkpoints.bodies import CopyWeightsBody, SaveWeightsExternalBody
from skylift.tinker.checkpoints.writer import CheckpointWriter, disk_quota
from skylift.tinker.core import durable
from skylift.tinker.errors import NotFoundError, UserError
from skylift.tinker.storage.store import CheckpointRow, ModelRow, SessionRow, Store, utcnow
from skylift.tinker.storage.views import (
    META_FILE,
    check_name,
    iso,
    parse_tinker_path,
    tinker_path,
)
from skylift.tinker.training.registry import ModelRegistry

if TYPE_CHECKING:
    from skylift.tinker.training.trained_model import TrainedModel

URL_TTL_S = 3600
SIGNED_PREFIX = "/signed/external_weights"
MIN_TTL_S, MAX_TTL_S = 3600, 10 * 365 * 86400


def ttl_expiry(ttl: Any, lowest: int = 1) -> dt.datetime | None:
    if ttl is None:
        return None
    if not isinstance(ttl, int | float) or isinstance(ttl, bool) or not lowest <= ttl <= MAX_TTL_S:
        raise UserError(f"ttl_seconds must be a number of seconds in [{lowest}, 10 years], got {ttl!r}")
    return utcnow() + dt.timedelta(seconds=int(ttl))


def _signature(secret: bytes, path: str, expires: int) -> str:
    return hmac.new(secret, f"{path}\n{expires}".encode(), hashlib.sha256).hexdigest()


class CheckpointOperations:
    """Checkpoints out and in (see the module docstring) over the store, the loaded models'
    operation path (`training.registry`: an export runs on the model's queue) and the writer."""

    def __init__(
        self, store: Store, registry: ModelRegistry, writer: CheckpointWriter, gb_per_user: float | None
    ) -> None:
        self.store, self.registry, self.writer, self.gb_per_user = store, registry, writer, gb_per_user
        self.url_secret = secrets.token_bytes(32)  # signs download URLs (valid while this process runs)

    def delete_checkpoint(self, path: str) -> CheckpointRow | None:
        """Delete a checkpoint's record and files; None when it does not exist (blocking)."""
        row = self.store.delete_checkpoint(path)
        if row is not None:
            shutil.rmtree(row.directory, ignore_errors=True)
        return row

    def delete_expired(self) -> None:
        """Delete the checkpoints whose TTL has passed (blocking)."""
        now = utcnow()
        for ckpt in self.store.checkpoints():
            if ckpt.expires_at is not None and ckpt.expires_at < now:
                self.delete_checkpoint(ckpt.tinker_path)

    def _checkpoint(self, run_id: str, checkpoint_id: str) -> CheckpointRow:
        segment, _, name = checkpoint_id.partition("/")
        path = f"tinker://{run_id}/{segment}/{name}"
        parse_tinker_path(path)
        return self.store.require_checkpoint(path)

    def _by_path(self, path: str) -> CheckpointRow:
        run_id, _, _ = parse_tinker_path(path)
        return self._checkpoint(run_id, path.removeprefix(f"tinker://{run_id}/"))

    def check_disk_quota(self, owner: str | None, adding: int) -> None:
        """Refuse (429) a new checkpoint of `owner` past its disk share (see
        `skylift.tinker.checkpoints.writer.disk_quota`; blocking: reads records)."""
        disk_quota(self.store, self.gb_per_user, owner, adding)

    # ---------------------------------------------------------------- external weights
    async def save_weights_external(self, body: SaveWeightsExternalBody, idem: str | None) -> str:
        model_id = body.model_id
        if body.age_encryption_recipients:
            raise UserError("age_encryption_recipients: this server does not encrypt exports")

        async def fn(model: TrainedModel) -> dict[str, Any]:
            name = check_name(body.path, "save_weights_external")
            expires_at = ttl_expiry(body.ttl_seconds)
            path, size = await self.writer.write(model.export_sampler, model_id, "external", name, expires_at)
            return {"path": path, "size_bytes": size, "type": "save_weights_external"}

        return await self.registry.submit_model_op("save_weights_external", model_id, body.seq_id, fn, idem)

    def external_weights_urls(self, run_id: str, checkpoint_id: str, base_url: str) -> dict[str, Any]:
        row = self._checkpoint(run_id, checkpoint_id)
        if row.kind != "external":
            raise UserError(
                f"{row.tinker_path} is not an external weights checkpoint (save_weights_external)"
            )
        root = Path(row.directory)
        expires = int(time.time()) + URL_TTL_S
        urls = {}
        for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name != META_FILE):
            rel = f.relative_to(root).as_posix()
            path = f"{SIGNED_PREFIX}/{run_id}/{row.checkpoint_id}/{rel}"  # signed as the server decodes it
            query = urllib.parse.urlencode(
                {"expires": expires, "sig": _signature(self.url_secret, path, expires)}
            )
            url_path = urllib.parse.quote(path)
            urls[rel] = f"{base_url.rstrip('/')}{url_path}?{query}"
        return {"urls": urls, "expires": iso(dt.datetime.fromtimestamp(expires, dt.UTC).replace(tzinfo=None))}

    def signed_file(self, url_path: str, expires: int, sig: str) -> Path:
        """The file a signed URL names (`url_path` percent-decoded); PermissionError when the signature
        is wrong or expired."""
        if expires < time.time():
            raise PermissionError("this download URL expired; ask for new ones (external_weights_urls)")
        if not hmac.compare_digest(
            _signature(self.url_secret, url_path, expires).encode(), sig.encode("utf-8", "replace")
        ):
            raise PermissionError("invalid download URL signature")
        rest = url_path.removeprefix(SIGNED_PREFIX + "/")
        run_id, segment, name, rel = rest.split("/", 3)
        row = self._checkpoint(run_id, f"{segment}/{name}")
        root = Path(row.directory).resolve()
        target = (root / rel).resolve()
        if not target.is_relative_to(root) or not target.is_file():
            raise NotFoundError(f"{rel} is not a file of {row.tinker_path}")
        return target

    # ---------------------------------------------------------------- publish, TTL, copy, info

    def set_public(self, run_id: str, checkpoint_id: str, public: bool) -> None:
        row = self._checkpoint(run_id, checkpoint_id)
        meta_path = Path(row.directory) / META_FILE
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        if bool(meta.get("public", False)) == public:
            state = "public" if public else "private"
            raise UserError(f"checkpoint {row.tinker_path} is already {state}")
        meta["public"] = public
        durable.write_text_atomic(meta_path, json.dumps(meta))

    def set_ttl(self, run_id: str, checkpoint_id: str, ttl_seconds: float | None) -> None:
        row = self._checkpoint(run_id, checkpoint_id)
        self.store.update(CheckpointRow, row.id, expires_at=ttl_expiry(ttl_seconds))

    def weights_info(self, path: str) -> dict[str, Any]:
        row = self._by_path(path)
        model = self.store.get(ModelRow, row.model_id)
        config = (model.config if model is not None else None) or {}
        rank = int(config.get("lora_rank", 0))
        return {
            "base_model": model.base_model if model is not None else "",
            "is_lora": rank > 0,
            "lora_rank": rank or None,
            "train_unembed": config.get("train_unembed"),
            "train_mlp": config.get("train_mlp"),
            "train_attn": config.get("train_attn"),
        }

    def copy_weights(self, body: CopyWeightsBody, owner: str | None = None) -> dict[str, Any]:
        """Copy a checkpoint into a new training run (unloaded) of the caller (`owner`):
        `<session_id>:train:<model_seq_id>` with a session of the caller, else `copy-<id>` in a new
        session of the caller (this server has no projects: a `destination_project_id` is accepted
        and only labels the copy). Never in the source's namespace: copying another user's
        published checkpoint gives the caller the copy."""
        source = self._by_path(body.source_path)
        src_model = self.store.get(ModelRow, source.model_id)
        session_id, seq = body.session_id, body.model_seq_id
        if session_id is not None:
            if seq is None:
                raise UserError("copy_weights: send model_seq_id (an integer >= 0) with session_id")
            self.store.require(SessionRow, session_id, "session")
            run_id = f"{session_id}:train:{seq}"
        elif body.destination_project_id:
            session_id, run_id = f"s{uuid.uuid4().hex[:16]}", f"copy-{uuid.uuid4().hex[:12]}"
            self.store.add(
                SessionRow(
                    id=session_id,
                    tags=["copy_weights"],
                    user_metadata={},
                    owner=owner,
                    finished_at=utcnow(),
                    finish_reason="copy_weights",
                )
            )
        else:
            raise UserError("copy_weights: send destination_project_id, or session_id and model_seq_id")
        _, kind, name = parse_tinker_path(source.tinker_path)
        path = tinker_path(run_id, kind, name)
        self.check_disk_quota(owner, int(source.size_bytes or 0))
        if self.store.checkpoint(path) is not None:
            raise UserError(f"copy_weights: {path} already exists")
        if self.store.get(ModelRow, run_id) is None:
            self.store.add(
                ModelRow(
                    model_id=run_id,
                    session_id=str(session_id),
                    base_model=src_model.base_model,
                    config=src_model.config,
                    status="unloaded",
                    user_metadata={
                        "copied_from": source.tinker_path,
                        "project": body.destination_project_id,
                    },
                )
            )
        final = self.writer.run_dir(run_id, kind, name)
        staging = durable.staging_dir(final)
        final.parent.mkdir(parents=True, exist_ok=True)
        try:
            shutil.copytree(source.directory, staging)
            meta_path = staging / META_FILE
            if meta_path.is_file():  # a copy starts private
                meta = json.loads(meta_path.read_text())
                meta.pop("public", None)
                meta_path.write_text(json.dumps(meta))
            directory = durable.commit_dir(staging, final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        self.store.put_checkpoint(
            CheckpointRow(
                tinker_path=path,
                model_id=run_id,
                checkpoint_id=source.checkpoint_id,
                kind=source.kind,
                directory=str(directory),
                size_bytes=source.size_bytes,
                expires_at=ttl_expiry(body.ttl_seconds, lowest=MIN_TTL_S),
                user_metadata=source.user_metadata,
            )
        )
        return {"tinker_path": path}
