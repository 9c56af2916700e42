"""What the delta publisher (`delta.publish`) and the engines' stores (`delta.apply`) agree on.

A published version lives in ``<sync_dir>/deltas/delta-NNNNNNNN/``: ``manifest.json`` and payload
files ``payload-NNNNN.bin``. A payload file is a run of zstd frames, one per changed tensor: the
tensor's new bytes XOR its bytes in the version before (`Manifest.base_version`; 0 = the base
checkpoint's weights in the same dtype, zeros for a tensor the checkpoint lacks), laid out as its
record's `encoding` says (`delta.encoding`: the patch itself, or its nonzero elements apart from
their positions). The manifest
lists, per changed tensor, its dtype, shape, byte size, where its frame is, and two checksums:
of the frame (a corrupt payload is refused before anything is applied from it) and of the new
bytes (a store that does not hold what the trainer XORed against is refused after patching).
Tensors absent from a manifest did not change. `run_id` tells one publisher's versions from an
earlier run's in the same directory.
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from skylift.utils.dtypes import dtype_to_str, str_to_dtype

DELTAS = "deltas"
MANIFEST = "manifest.json"
FORMAT = "skylift-delta-2"
#: formats a store reads (1: before `TensorRecord.encoding`, every patch ``xor``)
READABLE_FORMATS = ("skylift-delta-1", FORMAT)
CHECKSUM = "blake2b-128"
ZSTD_LEVEL = 1


class DeltaError(RuntimeError):
    """A delta version could not be published, found or applied."""


class DeltaVersionNotFound(DeltaError):
    """No manifest for a version under the sync directory."""


class CorruptPayloadError(DeltaError):
    """A payload's bytes do not match the manifest's checksum (names the file)."""


def checksum(data: bytes | memoryview) -> str:
    """The checksum of the manifest (`CHECKSUM`)."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def default_store_dir(sync_dir: str | Path) -> Path:
    """The engine host's store for `sync_dir` when no local_checkpoint_dir is given."""
    where = str(sync_dir) if "://" in str(sync_dir) else str(Path(sync_dir).resolve())
    key = hashlib.sha1(where.encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / "skylift_delta_checkpoints" / key


def version_dir(sync_dir: str | Path, version: int) -> Path:
    return Path(sync_dir) / DELTAS / f"delta-{version:08d}"


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A CPU tensor's bytes as a flat uint8 tensor (a view when it is already contiguous on CPU)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat


def from_bytes(data: torch.Tensor, dtype: str, shape: list[int]) -> torch.Tensor:
    """The tensor of `dtype` and `shape` whose bytes are `data` (a view)."""
    return data.view(str_to_dtype(dtype)).reshape(shape)


@dataclass
class TensorRecord:
    """One changed tensor of a version."""

    name: str
    dtype: str
    shape: list[int]
    nbytes: int
    file: str  # payload file name in the version's directory
    offset: int
    length: int  # compressed bytes
    checksum: str  # of the new bytes
    payload_checksum: str  # of the compressed frame
    encoding: str = "xor"  # how the patch is laid out in the frame (`delta.encoding`)


@dataclass
class Manifest:
    """What one published version changed, relative to `base_version`."""

    version: int
    base_version: int
    run_id: str
    tensors: list[TensorRecord] = field(default_factory=list)
    format: str = FORMAT
    checksum: str = CHECKSUM

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Manifest:
        if data.get("format") not in READABLE_FORMATS or data.get("checksum") != CHECKSUM:
            raise DeltaError(
                f"manifest format {data.get('format')!r}/{data.get('checksum')!r}, expected one of "
                f"{READABLE_FORMATS} with {CHECKSUM!r}"
            )
        records = [TensorRecord(**r) for r in data["tensors"]]
        return cls(int(data["version"]), int(data["base_version"]), str(data["run_id"]), records)


def read_manifest(sync_dir: str | Path, version: int) -> Manifest:
    """The manifest of `version`; `DeltaVersionNotFound` when it was never published (completely)."""
    path = version_dir(sync_dir, version) / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise DeltaVersionNotFound(f"version {version} is not published: no {path}") from None
    try:
        return Manifest.from_json(json.loads(text))
    except (ValueError, KeyError, TypeError) as exc:
        raise DeltaError(f"unreadable manifest {path}: {exc}") from exc


def resolve_base_dir(model: str | None) -> Path | None:
    """The local directory of a model's checkpoint (a registry name, a directory, or a Hub id
    already downloaded), or None: then both sides XOR the first version against zeros."""
    if not model:
        return None
    from skylift.models import resolve_model_path

    path = Path(resolve_model_path(model))
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True))
    except Exception:  # noqa: BLE001 - not in the local cache: no base
        return None


class BaseWeights:
    """The base checkpoint's tensors (its ``*.safetensors`` files), read lazily by name."""

    def __init__(self, model_dir: Path | None) -> None:
        self.dir = model_dir
        self._index: dict[str, Path] | None = None

    def index(self) -> dict[str, Path]:
        if self._index is None:
            from safetensors import safe_open

            self._index = {}
            for path in sorted(self.dir.glob("*.safetensors")) if self.dir is not None else []:
                with safe_open(str(path), framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                        self._index[name] = path
        return self._index

    def tensor(self, name: str) -> torch.Tensor | None:
        path = self.index().get(name)
        if path is None:
            return None
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            return f.get_tensor(name)

    def bytes_of(self, name: str, dtype: str, shape: list[int]) -> torch.Tensor | None:
        """The base tensor `name` cast to `dtype`, as bytes; None when the checkpoint has no
        tensor of that name and shape (it then counts as zeros)."""
        tensor = self.tensor(name)
        if tensor is None or list(tensor.shape) != list(shape):
            return None
        return as_bytes(tensor.to(str_to_dtype(dtype)))


def dtype_name(tensor: torch.Tensor) -> str:
    return dtype_to_str(tensor.dtype)
