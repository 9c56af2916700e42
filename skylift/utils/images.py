"""Images as datasets and environments hand them over, decoded into RGB PIL images.

What HF datasets store in parquet (``{"bytes": ..., "path": ...}``), raw bytes, a file path or
``file://`` URL, a ``data:image/...;base64,`` URL, or a PIL image. Anything else, or bytes that
do not decode, is an `ImageError` naming where the image came from.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
from pathlib import Path
from typing import Any


class ImageError(ValueError):
    """An image that cannot be read (the message names where it came from)."""


def _open(data: bytes, where: str) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError) as exc:
        raise ImageError(f"{where}: not a decodable image ({exc})") from exc
    return image.convert("RGB")


def _from_path(path: str, where: str) -> Any:
    if path.startswith("file://"):
        path = urllib.parse.unquote(urllib.parse.urlparse(path).path)
    file = Path(path).expanduser()
    if not file.is_file():
        raise ImageError(f"{where}: image file not found: {file}")
    return _open(file.read_bytes(), where)


def load_image(value: Any, where: str = "image") -> Any:
    """`value` as an RGB PIL image (see the module docstring for what it may be)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value if value.mode == "RGB" else value.convert("RGB")
    if isinstance(value, bytes | bytearray | memoryview):
        return _open(bytes(value), where)
    if isinstance(value, dict):
        if value.get("bytes"):
            return _open(bytes(value["bytes"]), where)
        if value.get("path"):
            return _from_path(str(value["path"]), where)
        url = value.get("url") or (value.get("image_url") or {}).get("url")
        if url:
            return load_image(str(url), where)
        raise ImageError(f"{where}: an image dict needs 'bytes' or 'path', got keys {sorted(value)}")
    if isinstance(value, str):
        if value.startswith("data:"):
            try:
                return _open(base64.b64decode(value.split(",", 1)[1], validate=True), where)
            except (IndexError, binascii.Error) as exc:
                raise ImageError(f"{where}: bad base64 image data URL") from exc
        if "://" in value and not value.startswith("file://"):
            raise ImageError(f"{where}: only local paths, file:// and data: URLs are read, got {value:.60}")
        return _from_path(value, where)
    raise ImageError(f"{where}: cannot read an image from a {type(value).__name__}")


__all__ = ["ImageError", "load_image"]
