"""`DeltaStore`: an engine host's copy of the policy's weights, patched version by version from
what `delta.publish` wrote (``weight_sync_backend=delta``).

The store is a directory (``local_checkpoint_dir``; the engines of one host may share it):
``state.json`` (the run and version applied, and the file of every tensor that changed since the
base checkpoint), ``tensors/`` (each such tensor's bytes in one file) and ``.lock`` (an exclusive
file lock while applying, a shared one while reading). Tensors absent from the state are the base
checkpoint's (`delta.format.BaseWeights`).

`apply(sync_dir, v)` brings the store to version v: it follows the manifests back from v by their
base versions to the version the store holds (replaying every version it missed, in order) or,
for another run's versions, to the base checkpoint (the store is then reset). Each frame's
checksum is checked before it is used (a corrupt payload is refused naming the file), each
patched tensor's after; a version's new tensor files are written beside the old ones and the state
file, replaced atomically, commits them: a failure leaves the store at the version before.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from skylift.utils.dtypes import str_to_dtype
from skylift.utils.durable_files import write_bytes_atomic
from skylift.weight_sync.delta.encoding import decode_patch
from skylift.weight_sync.delta.format import (
    BaseWeights,
    CorruptPayloadError,
    DeltaError,
    DeltaVersionNotFound,
    Manifest,
    TensorRecord,
    checksum,
    from_bytes,
    read_manifest,
    version_dir,
)

logger = logging.getLogger(__name__)

STATE = "state.json"


@dataclass
class StoreState:
    """What a store holds: `version` of run `run_id` ("" and 0: the base checkpoint)."""

    run_id: str = ""
    version: int = 0
    #: name -> {"file", "dtype", "shape"} of every tensor that differs from the base checkpoint
    tensors: dict[str, dict] = field(default_factory=dict)


class DeltaStore:
    """The patched copy of the weights in `directory`, over the base checkpoint in `base_dir`."""

    def __init__(self, directory: str | Path, base_dir: Path | None) -> None:
        self.dir = Path(directory)
        self.base = BaseWeights(base_dir)

    # ---- state and lock
    @contextlib.contextmanager
    def _locked(self, exclusive: bool) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        with open(self.dir / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _read_state(self) -> StoreState:
        path = self.dir / STATE
        if not path.exists():
            return StoreState()
        data = json.loads(path.read_text())
        return StoreState(str(data["run_id"]), int(data["version"]), dict(data["tensors"]))

    def _write_state(self, state: StoreState) -> None:
        data = {"run_id": state.run_id, "version": state.version, "tensors": state.tensors}
        write_bytes_atomic(self.dir / STATE, json.dumps(data).encode())

    def state(self) -> StoreState:
        with self._locked(exclusive=False):
            return self._read_state()

    # ---- applying
    def _chain(self, sync_dir: str | Path, version: int, state: StoreState) -> tuple[list[Manifest], bool]:
        """The manifests to apply, oldest first, and whether the store must be reset to the base."""
        chain: list[Manifest] = []
        manifest = read_manifest(sync_dir, version)
        while True:
            chain.append(manifest)
            if manifest.run_id == state.run_id and manifest.base_version == state.version:
                return chain[::-1], False
            if manifest.base_version == 0:
                return chain[::-1], True
            manifest = read_manifest(sync_dir, manifest.base_version)

    def apply(self, sync_dir: str | Path, version: int) -> list[int]:
        """Bring the store to `version` (see the module docstring); the versions applied."""
        with self._locked(exclusive=True):
            state = self._read_state()
            target = read_manifest(sync_dir, version)
            if target.run_id == state.run_id and state.version >= version:
                if state.version > version:
                    raise DeltaError(
                        f"the store {self.dir} holds version {state.version}, newer than the requested "
                        f"{version}: a store cannot go back"
                    )
                return []
            chain, reset = self._chain(sync_dir, version, state)
            if reset:  # only the files this store wrote (the directory is the client's choice)
                for entry in state.tensors.values():
                    (self.dir / "tensors" / entry["file"]).unlink(missing_ok=True)
                state = StoreState(run_id=chain[0].run_id)
                self._write_state(state)
            for manifest in chain:
                state = self._apply_one(Path(sync_dir), manifest, state)
            return [m.version for m in chain]

    def _apply_one(self, sync_dir: Path, manifest: Manifest, state: StoreState) -> StoreState:
        where = version_dir(sync_dir, manifest.version)
        tensors_dir = self.dir / "tensors"
        tensors_dir.mkdir(parents=True, exist_ok=True)
        written: list[Path] = []
        new_tensors = dict(state.tensors)
        try:
            for record in manifest.tensors:
                new = self._patched(where, record, state)
                file = tensors_dir / f"{_file_key(record.name)}-{manifest.version:08d}.bin"
                file.write_bytes(new.numpy().tobytes())
                written.append(file)
                new_tensors[record.name] = {"file": file.name, "dtype": record.dtype, "shape": record.shape}
        except BaseException:
            for file in written:
                file.unlink(missing_ok=True)
            raise
        new_state = StoreState(manifest.run_id, manifest.version, new_tensors)
        self._write_state(new_state)
        for name, entry in state.tensors.items():  # files the new state no longer names
            if new_tensors[name]["file"] != entry["file"]:
                (tensors_dir / entry["file"]).unlink(missing_ok=True)
        logger.debug("delta store %s: version %d applied", self.dir, manifest.version)
        return new_state

    def _patched(self, where: Path, record: TensorRecord, state: StoreState) -> torch.Tensor:
        import zstandard

        path = where / record.file
        try:
            with open(path, "rb") as f:
                f.seek(record.offset)
                frame = f.read(record.length)
        except OSError as exc:
            raise CorruptPayloadError(f"payload {path} of tensor {record.name!r}: {exc}") from exc
        if len(frame) != record.length or checksum(frame) != record.payload_checksum:
            raise CorruptPayloadError(
                f"payload {path} is corrupt: the bytes of tensor {record.name!r} (offset {record.offset}, "
                f"{record.length} bytes) do not match the manifest's checksum; version not applied"
            )
        try:
            data = zstandard.ZstdDecompressor().decompress(frame, max_output_size=record.nbytes)
            element_size = str_to_dtype(record.dtype).itemsize
            new = decode_patch(record.encoding, data, record.nbytes, element_size)
        except (zstandard.ZstdError, ValueError) as exc:
            raise CorruptPayloadError(
                f"payload {path}: tensor {record.name!r} does not decode: {exc}"
            ) from exc
        if new.numel() != record.nbytes:
            raise CorruptPayloadError(
                f"payload {path}: tensor {record.name!r} has {new.numel()} bytes, the manifest says {record.nbytes}"
            )
        old = self._bytes(record.name, record.dtype, record.shape, state)
        if old is not None:
            if old.numel() != new.numel():
                old = None
            else:
                new = torch.bitwise_xor(new, old)
        if checksum(new.numpy().data) != record.checksum:
            raise DeltaError(
                f"tensor {record.name!r} of {where.name} does not match the trainer's "
                f"after patching: the store {self.dir} (or its base checkpoint {self.base.dir}) does not "
                "hold what the trainer XORed against; the engines and the trainer must start from the "
                "same checkpoint"
            )
        return new

    def _bytes(self, name: str, dtype: str, shape: list[int], state: StoreState) -> torch.Tensor | None:
        entry = state.tensors.get(name)
        return self.base.bytes_of(name, dtype, shape) if entry is None else self._stored(entry)

    def _stored(self, entry: dict) -> torch.Tensor:
        """The bytes of a tensor the store wrote (its `StoreState.tensors` entry)."""
        return torch.frombuffer(
            bytearray((self.dir / "tensors" / entry["file"]).read_bytes()), dtype=torch.uint8
        )

    # ---- reading
    def changed_since(self, sync_dir: str | Path, run_id: str, version: int) -> list[str] | None:
        """Names of the tensors that changed from `version` of `run_id` to the store's version, or
        None when the store's versions do not lead back to it (another run, or a later one)."""
        state = self.state()
        if run_id != state.run_id or version > state.version:
            return None
        names: set[str] = set()
        at = state.version
        while at > version:
            try:
                manifest = read_manifest(sync_dir, at)
            except DeltaVersionNotFound:  # deleted after a rebase (see delta.publish)
                return None
            names.update(r.name for r in manifest.tensors)
            at = manifest.base_version
        return sorted(names) if at == version else None

    def all_names(self) -> list[str]:
        """Every tensor the store can give: the base checkpoint's and the changed ones."""
        return sorted(set(self.base.index()) | set(self.state().tensors))

    def tensors(self, names: list[str], run_id: str, version: int) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) of `names` as of `version` of `run_id` (refused when the store holds
        another): the store's bytes, or the base checkpoint's for a tensor that never changed."""
        with self._locked(exclusive=False):
            state = self._read_state()
            if (state.run_id, state.version) != (run_id, version):
                raise DeltaError(
                    f"the store {self.dir} holds version {state.version} of run {state.run_id or '-'}, "
                    f"not version {version} of run {run_id}"
                )
            for name in names:
                entry = state.tensors.get(name)
                if entry is not None:
                    yield name, from_bytes(self._stored(entry), entry["dtype"], entry["shape"])
                    continue
                tensor = self.base.tensor(name)
                if tensor is None:
                    raise DeltaError(
                        f"tensor {name!r} is neither in the store {self.dir} nor in the base checkpoint"
                    )
                yield name, tensor


def _file_key(name: str) -> str:
    return hashlib.sha1(name.encode()).hexdigest()[:24]
