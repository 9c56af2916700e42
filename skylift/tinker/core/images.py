"""Image chunks of Tinker model inputs: reading, checking and turning them into data URLs.

Two chunk kinds carry images: ``image`` (bytes, base64 in JSON, raw in protobuf) and
``image_asset_pointer`` (a local path or a ``file://`` URL the server reads, only under the
directories the operator allows with ``--allowed-local-media-path``). Both declare a
``format`` (png or jpeg) and may state ``expected_tokens``. Anything wrong with one (bad base64,
an unreadable pointer, bytes that are not a decodable PNG/JPEG, another format) is a `UserError`
naming the datum and chunk.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
import stat
import urllib.parse
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skylift.tinker.errors import UserError

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG"}
MAX_IMAGE_BYTES = 32 * 1024 * 1024
#: Most pixels of one image, checked from its header before it is decoded (a small PNG can
#: declare a huge canvas).
MAX_IMAGE_PIXELS = 4096 * 4096


@dataclass(frozen=True)
class ImageInput:
    """One checked image: its bytes, normalised format (png|jpeg) and optional expected token count."""

    data: bytes
    format: str
    expected_tokens: int | None = None
    where: str = "image"

    def data_url(self) -> str:
        return f"data:image/{self.format};base64,{base64.b64encode(self.data).decode('ascii')}"


def _format(raw: Any, where: str) -> str:
    name = str(raw or "").lower()
    if name not in IMAGE_FORMATS:
        raise UserError(f"{where}: unknown image format {raw!r}; send png or jpeg")
    return "jpeg" if name == "jpg" else name


def _expected(raw: Any, where: str) -> int | None:
    if raw is None or raw == 0:  # protobuf's unset int is 0
        return None
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        raise UserError(f"{where}: expected_tokens must be a non-negative integer, got {raw!r}")
    return raw


def check_image(data: bytes, fmt: str, where: str, expected_tokens: int | None = None) -> ImageInput:
    """Decode `data` fully; it must be a PNG or JPEG image of the declared format."""
    from PIL import Image, UnidentifiedImageError

    fmt = _format(fmt, where)
    if not data:
        raise UserError(f"{where}: the image is empty")
    if len(data) > MAX_IMAGE_BYTES:
        raise UserError(f"{where}: the image has {len(data)} bytes; at most {MAX_IMAGE_BYTES} are accepted")
    try:
        with Image.open(io.BytesIO(data)) as image:
            actual = image.format
            width, height = image.size
            if width * height > MAX_IMAGE_PIXELS:
                raise UserError(
                    f"{where}: the image is {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} pixels "
                    "are accepted (resize it before sending)"
                )
            image.load()  # decodes every pixel: truncated or corrupt data fails here
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise UserError(f"{where}: cannot decode the {fmt} image: {exc}") from exc
    if actual != IMAGE_FORMATS[fmt]:
        raise UserError(f"{where}: declared format {fmt!r} but the data is {actual or 'unknown'}")
    return ImageInput(data=data, format=fmt, expected_tokens=expected_tokens, where=where)


def _pointer_path(location: str, where: str) -> Path:
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise UserError(f"{where}: file URL {location!r} names a remote host")
        return Path(urllib.request.url2pathname(parsed.path))
    if parsed.scheme == "":
        return Path(location)
    raise UserError(
        f"{where}: cannot read image location {location!r}: only local paths and file:// URLs are supported"
    )


def _open_under(root: Path, parts: tuple[str, ...]) -> int:
    """A read-only descriptor of `root/parts...`, opened one component at a time without
    following links (O_NOFOLLOW), the file itself without blocking (O_NONBLOCK: a FIFO answers
    at once); OSError for anything else."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in parts[:-1]:
            step = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = step
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | getattr(os, "O_NOCTTY", 0)
        return os.open(parts[-1], flags, dir_fd=fd)
    finally:
        os.close(fd)


def read_pointer(location: str, where: str, roots: Sequence[Path] = ()) -> bytes:
    """The bytes an ``image_asset_pointer`` names: a local path or a ``file://`` URL of a regular
    file under one of `roots` (the operator's ``--allowed-local-media-path``; none: every pointer
    is refused), read up to `MAX_IMAGE_BYTES`. Blocking: call it off the event loop.

    A path that is missing, outside the roots, reached through a link, or not a regular file
    gets one and the same message (no existence oracle)."""
    if not isinstance(location, str) or not location:
        raise UserError(f"{where}: image_asset_pointer needs a location (a path or file:// URL)")
    if not roots:
        raise UserError(
            f"{where}: image_asset_pointer chunks are refused: this server reads no local files "
            "(the operator allows a directory with --allowed-local-media-path DIR); send the image "
            "bytes in an image chunk instead"
        )
    path = _pointer_path(location, where)
    unreadable = UserError(
        f"{where}: cannot read image {location!r}: not a readable regular file under the allowed media "
        "directories (--allowed-local-media-path)"
    )
    if not path.is_absolute() or "\x00" in str(path):
        raise unreadable
    normal = Path(os.path.normpath(path))
    root = next((r for r in roots if normal.is_relative_to(r) and normal != r), None)
    if root is None:
        raise unreadable
    try:
        fd = _open_under(root, normal.relative_to(root).parts)
    except (OSError, ValueError):
        raise unreadable from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise unreadable
        if info.st_size > MAX_IMAGE_BYTES:
            raise UserError(f"{where}: {location!r} is larger than {MAX_IMAGE_BYTES} bytes")
        os.set_blocking(fd, True)
        chunks, size = [], 0
        while size <= MAX_IMAGE_BYTES:
            chunk = os.read(fd, min(1 << 20, MAX_IMAGE_BYTES + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > MAX_IMAGE_BYTES:  # it grew since fstat
            raise UserError(f"{where}: {location!r} is larger than {MAX_IMAGE_BYTES} bytes")
        return b"".join(chunks)
    except OSError:
        raise unreadable from None
    finally:
        os.close(fd)


def image_from_json(chunk: dict[str, Any], where: str, media_roots: Sequence[Path] = ()) -> ImageInput:
    """A JSON ``image`` or ``image_asset_pointer`` chunk as a checked `ImageInput` (a pointer
    only under `media_roots`; blocking: call it off the event loop)."""
    expected = _expected(chunk.get("expected_tokens"), where)
    fmt = _format(chunk.get("format"), where)
    if chunk.get("type") == "image":
        raw = chunk.get("data")
        if not isinstance(raw, str):
            raise UserError(f"{where}: image data must be a base64 string")
        try:
            data = base64.b64decode(raw, validate=True)
        except (binascii.Error, ValueError) as exc:
            raise UserError(f"{where}: image data is not valid base64: {exc}") from exc
    else:
        data = read_pointer(chunk.get("location", ""), where, media_roots)
    return check_image(data, fmt, where, expected)


def image_from_proto(data: bytes, fmt: str, expected_tokens: int, where: str) -> ImageInput:
    """A protobuf ``ImageChunk`` as a checked `ImageInput`."""
    return check_image(data, fmt, where, _expected(int(expected_tokens), where))
