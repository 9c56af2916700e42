"""`DeltaPublisher`: the trainer's half of checkpoint-delta weight sync (``weight_sync_backend=delta``).

It runs on the policy's rank 0 over the same full-tensor iterator the bucketed sender reads
(every rank drives the FSDP2 gathers; the others discard the tensors). It keeps a CPU snapshot of
every tensor's bytes as last published, seeded from the base checkpoint in the dtype sent (the
engines' dtype). `publish` XORs each tensor's new bytes with the snapshot, skips the unchanged
ones, zstd-compresses the patches (in `num_workers` threads) into payload files of at most
`max_file_bytes` each (a frame larger than that gets a file of its own), writes the manifest
(`delta.format`), and moves the whole version into place with one rename; then, and only then, it
updates the snapshot. The version directory appears complete or not at all.

With `rebase_interval` N, every N-th version is published against the base checkpoint instead of
the version before (it carries every tensor that differs from the base: an engine reaches it from
the base alone) and the versions before it are deleted, so `sync_dir` never holds more than N
versions. Without it every version is kept.

A ``gs://`` or ``s3://`` `sync_dir` is written through a local staging directory: each version is
published there as above, then uploaded (`delta.cloud.upload_version`: payloads first, the
manifest last) and removed locally.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
import uuid
from collections import deque
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from skylift.config.delta_sync import is_cloud_uri
from skylift.utils.durable_files import fsync_dir, write_bytes_atomic
from skylift.weight_sync.buckets import NamedTensor
from skylift.weight_sync.delta.cloud import clear_versions, delete_versions_before, upload_version
from skylift.weight_sync.delta.encoding import XOR, encode_patch
from skylift.weight_sync.delta.format import (
    DELTAS,
    MANIFEST,
    ZSTD_LEVEL,
    BaseWeights,
    DeltaError,
    Manifest,
    TensorRecord,
    as_bytes,
    checksum,
    dtype_name,
    version_dir,
)

logger = logging.getLogger(__name__)


@dataclass
class PublishStats:
    """What one `publish` wrote."""

    version: int
    tensors: int  # seen
    changed: int
    raw_bytes: int  # of the changed tensors
    compressed_bytes: int
    files: int
    seconds: float

    def metrics(self) -> dict[str, float]:
        return {
            "weight_sync/delta_version": float(self.version),
            "weight_sync/delta_changed_tensors": float(self.changed),
            "weight_sync/bytes": float(self.compressed_bytes),
            "weight_sync/delta_raw_bytes": float(self.raw_bytes),
            "timing/delta_publish_s": self.seconds,
        }


@dataclass
class _Patch:
    name: str
    dtype: str
    shape: list[int]
    new: torch.Tensor  # the new bytes (the snapshot's next value)
    frame: bytes | None  # None: unchanged
    encoding: str = XOR


class _PayloadWriter:
    """Appends frames to payload files of at most `max_bytes` each (fsynced when closed)."""

    def __init__(self, directory: Path, max_bytes: int) -> None:
        self.dir, self.max_bytes = directory, max_bytes
        self.files: list[str] = []
        self._file = None
        self._size = 0

    def add(self, frame: bytes) -> tuple[str, int]:
        if self._file is None or (self._size and self._size + len(frame) > self.max_bytes):
            self._close_current()
            name = f"payload-{len(self.files):05d}.bin"
            self.files.append(name)
            self._file = open(self.dir / name, "wb")  # noqa: SIM115 - closed by _close_current
            self._size = 0
        offset = self._size
        self._file.write(frame)
        self._size += len(frame)
        return self.files[-1], offset

    def _close_current(self) -> None:
        if self._file is not None:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._file = None

    def close(self) -> None:
        self._close_current()


class DeltaPublisher:
    """Publishes versions 1, 2, ... of one run under `sync_dir` (see the module docstring).

    `base_dir`: the base checkpoint the engines start from (None: the first version is XORed
    against zeros, i.e. carries every tensor)."""

    def __init__(
        self,
        sync_dir: str | Path,
        base_dir: Path | None,
        max_file_bytes: int = 1 << 30,
        num_workers: int | None = None,
        staging_dir: str | Path | None = None,
        rebase_interval: int | None = None,
    ) -> None:
        """`staging_dir`: with a gs:// or s3:// `sync_dir`, where versions are written before
        their upload (None: a temporary directory). `rebase_interval`: see the module docstring."""
        if max_file_bytes < 1:
            raise ValueError(f"max_file_bytes={max_file_bytes} must be >= 1")
        if rebase_interval is not None and rebase_interval < 1:
            raise ValueError(f"rebase_interval={rebase_interval} must be >= 1 or None")
        self.rebase_interval = rebase_interval
        self.remote = str(sync_dir) if is_cloud_uri(str(sync_dir)) else None
        if self.remote is not None:
            staging = Path(staging_dir) if staging_dir else Path(tempfile.mkdtemp(prefix="skylift-delta-"))
            self.sync_dir = staging / uuid.uuid4().hex
        else:
            self.sync_dir = Path(sync_dir)
        self.base = BaseWeights(base_dir)
        self.max_file_bytes = max_file_bytes
        self.num_workers = num_workers or min(8, os.cpu_count() or 1)
        self.run_id = uuid.uuid4().hex
        self.version = 0  # the last version published
        self.snapshot: dict[str, torch.Tensor] = {}

    def _patch(self, name: str, tensor: torch.Tensor, rebase: bool) -> _Patch:
        """The frame of `tensor` against the snapshot, or against the base checkpoint (`rebase`)."""
        dtype, shape = dtype_name(tensor), list(tensor.shape)
        new = as_bytes(tensor)
        if new.data_ptr() == tensor.data_ptr():  # a view of the trainer's tensor: keep a copy
            new = new.clone()
        old = None if rebase else self.snapshot.get(name)
        if old is None or old.numel() != new.numel():
            old = self.base.bytes_of(name, dtype, shape)
        if old is not None and torch.equal(old, new):
            return _Patch(name, dtype, shape, new, None)
        import zstandard

        if old is None:
            encoding, data = XOR, new.numpy().tobytes()
        else:
            encoding, data = encode_patch(torch.bitwise_xor(old, new), tensor.element_size())
        frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)
        return _Patch(name, dtype, shape, new, frame, encoding)

    def _start(self) -> Path:
        """A fresh temporary directory for the next version; a new run first clears the versions
        an earlier run left in `sync_dir`."""
        deltas = self.sync_dir / DELTAS
        deltas.mkdir(parents=True, exist_ok=True)
        if self.version == 0:
            for old in deltas.glob("delta-*"):
                logger.info("delta sync: removing %s, left by an earlier run", old)
                shutil.rmtree(old, ignore_errors=True)
            if self.remote is not None:
                clear_versions(self.remote)
        tmp = deltas / f".tmp-{uuid.uuid4().hex}"
        tmp.mkdir()
        return tmp

    def _delete_before(self, version: int) -> None:
        """Remove the versions before `version` (published against the base: no store needs them)."""
        if self.remote is not None:
            delete_versions_before(self.remote, version)
            return
        for old in (self.sync_dir / DELTAS).glob("delta-*"):
            if int(old.name.removeprefix("delta-")) < version:
                shutil.rmtree(old, ignore_errors=True)

    def publish(self, tensors: Iterable[NamedTensor]) -> PublishStats:
        """Publish the next version from `tensors` (name, full tensor in the dtype sent)."""
        started = time.perf_counter()
        version = self.version + 1
        rebase = self.rebase_interval is not None and version % self.rebase_interval == 0
        self.base.index()  # built once, before the threads read it
        tmp = self._start()
        writer = _PayloadWriter(tmp, self.max_file_bytes)
        records: list[TensorRecord] = []
        updates: dict[str, torch.Tensor] = {}
        seen = 0

        def take(patch: _Patch) -> None:
            if patch.frame is None:
                if rebase:  # equal to the base: the snapshot takes it (it may differ from the last)
                    updates[patch.name] = patch.new
                else:
                    self.snapshot.setdefault(patch.name, patch.new)
                return
            file, offset = writer.add(patch.frame)
            records.append(
                TensorRecord(
                    name=patch.name,
                    dtype=patch.dtype,
                    shape=patch.shape,
                    nbytes=patch.new.numel(),
                    file=file,
                    offset=offset,
                    length=len(patch.frame),
                    checksum=checksum(patch.new.numpy().data),
                    payload_checksum=checksum(patch.frame),
                    encoding=patch.encoding,
                )
            )
            updates[patch.name] = patch.new

        try:
            with ThreadPoolExecutor(self.num_workers, thread_name_prefix="delta-publish") as pool:
                pending: deque[Future[_Patch]] = deque()
                for name, tensor in tensors:
                    seen += 1
                    pending.append(pool.submit(self._patch, name, tensor, rebase))
                    while len(pending) > 2 * self.num_workers:
                        take(pending.popleft().result())
                while pending:
                    take(pending.popleft().result())
            writer.close()
            manifest = Manifest(
                version=version,
                base_version=0 if rebase else self.version,
                run_id=self.run_id,
                tensors=records,
            )
            write_bytes_atomic(tmp / MANIFEST, json.dumps(manifest.to_json()).encode())  # fsyncs tmp
            final = version_dir(self.sync_dir, version)
            if final.exists():
                shutil.rmtree(final)
            os.rename(tmp, final)
            fsync_dir(final.parent)
            if self.remote is not None:
                upload_version(final, self.remote, version)
                shutil.rmtree(final, ignore_errors=True)
            if rebase:
                self._delete_before(version)
        except BaseException as exc:
            writer.close()
            shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise DeltaError(
                    f"delta sync: publishing version {version} under {self.remote or self.sync_dir}: {exc}"
                ) from exc
            raise
        self.snapshot.update(updates)
        self.version = version
        return PublishStats(
            version=version,
            tensors=seen,
            changed=len(records),
            raw_bytes=sum(r.nbytes for r in records),
            compressed_bytes=sum(r.length for r in records),
            files=len(writer.files),
            seconds=time.perf_counter() - started,
        )
