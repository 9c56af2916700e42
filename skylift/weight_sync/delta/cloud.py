"""Delta sync directories in object storage (``s3://``, ``gs://``), through fsspec.

The publisher and the engines keep working on local directories; this module moves versions
between those and the bucket:

- `upload_version`: the publisher writes a version in a local staging directory
  (``delta_weight_sync.publish_staging_dir``, else a temporary one), then uploads its payload
  files and, last, its manifest: a manifest in the bucket means a complete version, as the rename
  does locally.
- `mirror_chain`: an engine host copies the versions its store needs into a local mirror (beside
  its store), from the requested one back by base versions to the version the store holds, and
  then applies them from the mirror as from a shared directory. A mirrored version is copied again
  when the bucket's manifest differs from the mirror's (another run published the same number).
- `drop_payloads`: once applied, a mirrored version's payloads go; its manifest stays (the engine
  reads manifests to know which tensors changed since the version it holds).

Credentials and endpoints come from the storage library's usual settings (for S3, the
``AWS_*`` environment variables, e.g. ``AWS_ENDPOINT_URL`` for an S3-compatible server).
``s3://`` needs the ``s3fs`` package, ``gs://`` the ``gcsfs`` package (``pip install skylift[cloud]``).
"""

from __future__ import annotations

import json
import shutil
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from skylift.weight_sync.delta.format import (
    DELTAS,
    MANIFEST,
    DeltaError,
    DeltaVersionNotFound,
    Manifest,
    version_dir,
)

PACKAGES = {"s3": "s3fs", "gs": "gcsfs", "gcs": "gcsfs"}
CONNECT_TIMEOUT_S, READ_TIMEOUT_S, ATTEMPTS = 10, 120, 3
#: every request is bounded: a bucket that does not answer fails the call, naming the URI
OPTIONS: dict[str, dict[str, Any]] = {
    "s3": {
        "config_kwargs": {
            "connect_timeout": CONNECT_TIMEOUT_S,
            "read_timeout": READ_TIMEOUT_S,
            "retries": {"max_attempts": ATTEMPTS},
        }
    },
    "gs": {"timeout": READ_TIMEOUT_S},
    "gcs": {"timeout": READ_TIMEOUT_S},
}


def _filesystem(uri: str) -> tuple[Any, str]:
    """(fsspec filesystem, path inside it) of `uri`; a clear error when its library is missing."""
    import fsspec

    scheme = uri.split("://", 1)[0].lower()
    try:
        fs, path = fsspec.core.url_to_fs(uri, **OPTIONS.get(scheme, {}))
    except ImportError as exc:
        package = PACKAGES.get(scheme, "the fsspec implementation of " + scheme)
        raise DeltaError(f"delta sync to {uri}: install {package} to reach {scheme}:// ({exc})") from exc
    fs.invalidate_cache()  # listings another process changed since (fsspec keeps one instance)
    return fs, path


def _remote_version(root: str, version: int) -> str:
    return f"{root.rstrip('/')}/{DELTAS}/delta-{version:08d}"


def clear_versions(uri: str) -> None:
    """Remove the versions an earlier run left under `uri` (a new run starts at version 1)."""
    fs, root = _filesystem(uri)
    deltas = f"{root.rstrip('/')}/{DELTAS}"
    try:
        if fs.exists(deltas):
            fs.rm(deltas, recursive=True)
    except Exception as exc:  # noqa: BLE001 - the storage library's own errors too (botocore's are no OSError)
        raise DeltaError(f"delta sync: clearing {uri}/{DELTAS}: {exc}") from exc


def delete_versions_before(uri: str, version: int) -> None:
    """Remove the versions under `uri` numbered below `version`."""
    fs, root = _filesystem(uri)
    deltas = f"{root.rstrip('/')}/{DELTAS}"
    try:
        for path in fs.ls(deltas, detail=False):
            name = str(path).rstrip("/").rsplit("/", 1)[-1]
            if name.startswith("delta-") and name[6:].isdigit() and int(name[6:]) < version:
                fs.rm(path, recursive=True)
    except Exception as exc:  # noqa: BLE001 - the storage library's own errors too (botocore's are no OSError)
        raise DeltaError(f"delta sync: deleting old versions under {uri}: {exc}") from exc


def upload_version(local_dir: Path, uri: str, version: int) -> None:
    """Upload the published version in `local_dir`: payload files first, the manifest last."""
    fs, root = _filesystem(uri)
    remote = _remote_version(root, version)
    files = sorted(p for p in local_dir.iterdir() if p.is_file() and p.name != MANIFEST)
    try:
        if fs.exists(remote):  # a half upload of an earlier try: no manifest, or a stale one
            fs.rm(remote, recursive=True)
        for path in files:
            fs.put_file(str(path), f"{remote}/{path.name}")
        fs.put_file(str(local_dir / MANIFEST), f"{remote}/{MANIFEST}")
    except Exception as exc:  # noqa: BLE001 - the storage library's own errors too (botocore's are no OSError)
        raise DeltaError(f"delta sync: uploading version {version} to {uri}: {exc}") from exc


def _fetch_manifest(fs: Any, root: str, uri: str, version: int) -> bytes:
    path = f"{_remote_version(root, version)}/{MANIFEST}"
    try:
        return bytes(fs.cat_file(path))
    except FileNotFoundError:
        raise DeltaVersionNotFound(
            f"version {version} is not published: no {uri}/{DELTAS}/delta-{version:08d}/{MANIFEST}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the storage library's own errors too (botocore's are no OSError)
        raise DeltaError(f"delta sync: reading the manifest of version {version} from {uri}: {exc}") from exc


def _mirror_one(
    fs: Any, root: str, uri: str, manifest: Manifest, raw: bytes, mirror: Path, workers: int
) -> None:
    """Copy one version's payloads (`workers` files at once) into the mirror, then its manifest,
    then move it into place."""
    final = version_dir(mirror, manifest.version)
    tmp = final.with_name(f".tmp-{uuid.uuid4().hex}")
    tmp.mkdir(parents=True)
    remote = _remote_version(root, manifest.version)
    names = sorted({r.file for r in manifest.tensors})
    try:
        with ThreadPoolExecutor(
            max(1, min(workers, len(names) or 1)), thread_name_prefix="delta-get"
        ) as pool:
            list(pool.map(lambda name: fs.get_file(f"{remote}/{name}", str(tmp / name)), names))
        (tmp / MANIFEST).write_bytes(raw)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    except Exception as exc:  # noqa: BLE001 - the storage library's own errors too (botocore's are no OSError)
        raise DeltaError(f"delta sync: downloading version {manifest.version} from {uri}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def mirror_chain(uri: str, version: int, mirror: Path, held: tuple[str, int], workers: int = 4) -> list[int]:
    """Copy into `mirror` the versions a store holding `held` (run id, version) needs to reach
    `version` (see the module docstring), `workers` payload files at once; the versions copied,
    newest first."""
    fs, root = _filesystem(uri)
    copied: list[int] = []
    at = version
    while True:
        raw = _fetch_manifest(fs, root, uri, at)
        try:
            manifest = Manifest.from_json(json.loads(raw))
        except (ValueError, KeyError, TypeError) as exc:
            raise DeltaError(f"unreadable manifest of version {at} in {uri}: {exc}") from exc
        local = version_dir(mirror, at) / MANIFEST
        if manifest.run_id == held[0] and held[1] >= at:
            if not local.exists() or local.read_bytes() != raw:  # the store's manifests, for reading
                local.parent.mkdir(parents=True, exist_ok=True)
                local.write_bytes(raw)
            return copied
        if not local.exists() or local.read_bytes() != raw:
            _mirror_one(fs, root, uri, manifest, raw, mirror, workers)
            copied.append(at)
        if manifest.base_version == 0 or (manifest.run_id == held[0] and manifest.base_version == held[1]):
            return copied
        at = manifest.base_version


def drop_payloads(mirror: Path, versions: list[int]) -> None:
    """Remove the payload files of mirrored `versions` (applied already); keep their manifests."""
    for version in versions:
        where = version_dir(mirror, version)
        for path in where.glob("*"):
            if path.name != MANIFEST:
                path.unlink(missing_ok=True)
