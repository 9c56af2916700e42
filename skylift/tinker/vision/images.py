"""Image chunks of Tinker model inputs: reading, checking and turning them into data URLs.

Two chunk kinds carry images: ``image`` (bytes, base64 in JSON, raw in protobuf) and
``image_asset_pointer`` (a local path or a ``file://`` URL the server reads). Both declare a
``format`` (png or jpeg) and may state ``expected_tokens``. Anything wrong with one (bad base64,
an unreadable pointer, bytes that are not a decodable PNG/JPEG, another format) is a `UserError`
naming the datum and chunk.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skylift.tinker.errors import UserError

IMAGE_FORMATS = {"png": "PNG", "jpeg": "JPEG", "jpg": "JPEG"}
MAX_IMAGE_BYTES = 32 * 1024 * 1024


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
            image.load()  # decodes every pixel: truncated or corrupt data fails here
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as exc:
        raise UserError(f"{where}: cannot decode the {fmt} image: {exc}") from exc
    if actual != IMAGE_FORMATS[fmt]:
        raise UserError(f"{where}: declared format {fmt!r} but the data is {actual or 'unknown'}")
    return ImageInput(data=data, format=fmt, expected_tokens=expected_tokens, where=where)


def read_pointer(location: str, where: str) -> bytes:
    """The bytes an ``image_asset_pointer`` names: a local path or a ``file://`` URL."""
    if not isinstance(location, str) or not location:
        raise UserError(f"{where}: image_asset_pointer needs a location (a path or file:// URL)")
    parsed = urllib.parse.urlparse(location)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise UserError(f"{where}: file URL {location!r} names a remote host")
        path = Path(urllib.request.url2pathname(parsed.path))
    elif parsed.scheme == "":
        path = Path(location)
    else:
        raise UserError(
            f"{where}: cannot read image location {location!r}: only local paths and file:// URLs are supported"
        )
    try:
        if path.stat().st_size > MAX_IMAGE_BYTES:
            raise UserError(f"{where}: {path} is larger than {MAX_IMAGE_BYTES} bytes")
        return path.read_bytes()
    except OSError as exc:
        raise UserError(f"{where}: cannot read image {location!r}: {exc.strerror or exc}") from exc


def image_from_json(chunk: dict[str, Any], where: str) -> ImageInput:
    """A JSON ``image`` or ``image_asset_pointer`` chunk as a checked `ImageInput`."""
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
        data = read_pointer(chunk.get("location", ""), where)
    return check_image(data, fmt, where, expected)


def image_from_proto(data: bytes, fmt: str, expected_tokens: int, where: str) -> ImageInput:
    """A protobuf ``ImageChunk`` as a checked `ImageInput`."""
    return check_image(data, fmt, where, _expected(int(expected_tokens), where))
