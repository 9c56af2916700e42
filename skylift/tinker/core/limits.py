"""What one request may ask of a Tinker server, checked before anything is allocated.

`RequestLimits` holds the operator's limits (``skylift tinker serve`` flags, see docs/security.md).
Request bodies are read in chunks and refused (HTTP 413) once past ``--max-request-mb``; zstd
bodies are first counted as a stream that stops one byte past the same limit, keeping nothing (a
frame's declared size is never trusted), then inflated into a buffer of the counted size; JSON bodies refuse ``NaN`` / ``Infinity``. Decompression and decoding run
in a worker thread, never on the event loop; a large body's decompression past its first 8 MiB at a
lower priority (`skylift.tinker.core.bulk`).
"""

from __future__ import annotations

import asyncio
import io
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request

from skylift.config.services import ServerConfig
from skylift.tinker.core.bulk import BULK_AFTER_BYTES, run_bulk
from skylift.tinker.errors import TooLargeError, UserError

MIB = 1024 * 1024
_CHUNK = 1 << 20


@dataclass(frozen=True)
class RequestLimits:
    """The limits of one server (defaults: those of `ServerConfig`)."""

    max_body_bytes: int = 256 * MIB
    max_cells: int = 16 * MIB
    media_roots: tuple[Path, ...] = field(default_factory=tuple)

    @classmethod
    def from_config(cls, config: ServerConfig) -> RequestLimits:
        if config.max_request_mb <= 0 or config.max_request_cells <= 0:
            raise ValueError("--max-request-mb and --max-request-cells must be > 0")
        return cls(
            max_body_bytes=int(config.max_request_mb * MIB),
            max_cells=int(config.max_request_cells),
            media_roots=tuple(media_root(p) for p in config.allowed_local_media_paths),
        )

    def body_too_large(self, where: str, what: str = "the request body") -> TooLargeError:
        return TooLargeError(
            f"{where}: {what} is larger than this server's limit of {self.max_body_bytes} bytes "
            f"({self.max_body_bytes / MIB:g} MiB); the operator raises it with --max-request-mb"
        )


def media_root(path: str | Path) -> Path:
    """An allowed media directory as the server matches pointers against it: absolute and
    normalised, links in it kept (the operator's own choice; pointers below it never follow any)."""
    return Path(os.path.abspath(path))


def limits_of(request: Request) -> RequestLimits:
    limits = getattr(request.app.state, "limits", None)
    return limits if isinstance(limits, RequestLimits) else RequestLimits()


async def read_body(request: Request) -> bytes:
    """The raw body, refused (413) as soon as it passes the limit (Content-Length first)."""
    limits = limits_of(request)
    where = request.url.path
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limits.max_body_bytes:
        raise limits.body_too_large(where)
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limits.max_body_bytes:
            raise limits.body_too_large(where)
    return bytes(buf)


def _reader(raw: bytes) -> Any:
    import zstandard

    return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(raw), read_across_frames=True)


def _inflated_size(raw: bytes, upto: int) -> int:
    """How many bytes `raw` inflates to, counted up to `upto`: the stream is read into one
    `_CHUNK` scratch buffer again and again, so counting a bomb allocates nothing."""
    scratch = bytearray(_CHUNK)
    total = 0
    with _reader(raw) as reader:
        while total < upto:
            n = reader.readinto(scratch)
            if not n:
                break
            total += n
    return total


def _inflate_exactly(raw: bytes, size: int) -> bytes:
    """`raw` inflated into a buffer of the `size` `_inflated_size` counted."""
    out = bytearray(size)
    view = memoryview(out)
    done = 0
    with _reader(raw) as reader:
        while done < size:
            n = reader.readinto(view[done : done + _CHUNK])
            if not n:
                break
            done += n
    if done != size:  # the same bytes inflate the same way: a broken invariant, not bad input
        raise RuntimeError(f"zstd body inflated to {done} bytes, counted {size}")
    return bytes(out)


async def decompress_zstd(raw: bytes, cap: int, where: str, limits: RequestLimits | None = None) -> bytes:
    """`raw` (one or more zstd frames) decompressed, at most `cap` bytes: first counted without
    keeping the output (a 413 past `cap`, nothing allocated for a bomb), then inflated into a
    buffer of that size; a bad frame is a 400. Off the event loop; a body larger than
    `BULK_AFTER_BYTES` on the low-priority threads of `skylift.tinker.core.bulk`."""
    import zstandard

    try:
        size = await asyncio.to_thread(_inflated_size, raw, min(cap + 1, BULK_AFTER_BYTES))
        large = size >= BULK_AFTER_BYTES
        if large and cap + 1 > BULK_AFTER_BYTES:
            size = await run_bulk(_inflated_size, raw, cap + 1)
        if size > cap:
            raise (limits or RequestLimits(max_body_bytes=cap)).body_too_large(where, "the decompressed body")
        return await (
            run_bulk(_inflate_exactly, raw, size) if large else asyncio.to_thread(_inflate_exactly, raw, size)
        )
    except zstandard.ZstdError as exc:
        raise UserError(f"{where}: the body is not valid zstd: {exc}") from exc


async def read_payload(request: Request) -> bytes:
    """The body (limited), decompressed off the event loop when ``Content-Encoding: zstd``."""
    raw = await read_body(request)
    encoding = request.headers.get("content-encoding", "").lower().strip()
    if encoding in ("", "identity"):
        return raw
    if encoding != "zstd":
        raise UserError(f"{request.url.path}: unsupported Content-Encoding {encoding!r}; send zstd or none")
    limits = limits_of(request)
    return await decompress_zstd(raw, limits.max_body_bytes, request.url.path, limits)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number; send a finite number")


def parse_json(raw: bytes, where: str) -> dict[str, Any]:
    """A JSON object (NaN and Infinity refused); a 400 naming what is wrong otherwise."""
    try:
        body = json.loads(raw, parse_constant=_no_constant)
    except (ValueError, RecursionError) as exc:
        raise UserError(f"{where}: the body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise UserError(f"{where}: expected a JSON object")
    return body
