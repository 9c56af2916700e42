"""Images over ``/skylift/generate``: one list of base64-encoded image files per prompt.

The client (`encode_images`) sends each image as PNG bytes in base64; the server (`decode_images`)
checks, before it decodes anything, the number of images (per prompt and per request) and each
string's length (the body's declared bound, `MAX_IMAGE_BASE64_CHARS`), then reads each image's
header only and checks its format and size (`MAX_IMAGE_PIXELS`, and all of a request's together
`MAX_REQUEST_IMAGE_PIXELS`) before its pixels are decoded. Only bytes travel: a path or URL is never
opened on the server. Every refusal is an `ImageWireError` naming the prompt and the image (the
route's 400).

Each request is whole: the server keeps no images between requests, so a multi-turn rollout's
request carries every image of the rollout so far (its prompt's and its observations'), and the
limits above hold per request, i.e. for a rollout's images together at its last turn. The client
encodes each image once (`EncodedImages`, by content); the bytes are sent again every turn.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import threading
import warnings
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

#: Longest base64 string of one image (12 MiB of image file).
MAX_IMAGE_BASE64_CHARS = 16 << 20
#: Most images of one prompt, and of one request.
MAX_IMAGES_PER_PROMPT = 64
MAX_IMAGES_PER_REQUEST = 256
#: Largest image (width x height), and most pixels of one request's images together.
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_REQUEST_IMAGE_PIXELS = 1 << 26
#: Most base64 characters a client keeps of images it sent (`EncodedImages`).
DEFAULT_ENCODED_CHARS = 64 << 20
#: Image file formats the server decodes.
FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")


class ImageWireError(ValueError):
    """Images in a request that the server refuses (the message names which)."""


def _png_base64(image: Any) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


class EncodedImages:
    """The base64 PNG files of images a client sent, by content (mode, size and a digest of the
    pixels, so an image changed in place is encoded afresh): a multi-turn rollout sends all its
    images again every turn and a prompt's samples each send the prompt's, so each image is
    encoded once while it stays here (at most `max_chars` base64 characters; the least recently
    used leave first). Thread-safe (encoding runs off the event loop)."""

    def __init__(self, max_chars: int = DEFAULT_ENCODED_CHARS) -> None:
        self.max_chars = max_chars
        self.hits = self.misses = 0
        self._files: OrderedDict[tuple[Any, ...], str] = OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def encode(self, image: Any) -> str:
        """`image` as a base64 PNG file (from here when its pixels were encoded before)."""
        key = (image.mode, image.size, hashlib.blake2b(image.tobytes(), digest_size=16).digest())
        with self._lock:
            data = self._files.get(key)
            if data is not None:
                self._files.move_to_end(key)
                self.hits += 1
                return data
        data = _png_base64(image)
        with self._lock:
            self.misses += 1
            if key not in self._files and len(data) <= self.max_chars:
                self._files[key] = data
                self._chars += len(data)
                while self._chars > self.max_chars:
                    self._chars -= len(self._files.popitem(last=False)[1])
        return data


def encode_images(
    images: Sequence[Sequence[Any] | None], cache: EncodedImages | None = None
) -> list[list[str]]:
    """Per prompt, its PIL images as base64 PNG files (a prompt without images: an empty list);
    `cache`: files encoded before are taken from it."""
    encode = _png_base64 if cache is None else cache.encode
    return [[encode(image) for image in prompt_images or ()] for prompt_images in images]


def check_counts(images: Sequence[Sequence[str]], prompts: int) -> None:
    """One list per prompt, at most `MAX_IMAGES_PER_PROMPT` each and `MAX_IMAGES_PER_REQUEST` in all,
    each string at most `MAX_IMAGE_BASE64_CHARS` (nothing is decoded here)."""
    if len(images) != prompts:
        raise ImageWireError(f"images has {len(images)} lists for {prompts} prompts: one list per prompt")
    total = sum(len(p) for p in images)
    if total > MAX_IMAGES_PER_REQUEST:
        raise ImageWireError(
            f"{total} images in one request; this server takes at most {MAX_IMAGES_PER_REQUEST}"
        )
    for i, prompt_images in enumerate(images):
        if len(prompt_images) > MAX_IMAGES_PER_PROMPT:
            raise ImageWireError(
                f"prompt {i} has {len(prompt_images)} images; this server takes at most {MAX_IMAGES_PER_PROMPT}"
            )
        for j, data in enumerate(prompt_images):
            if len(data) > MAX_IMAGE_BASE64_CHARS:
                raise ImageWireError(
                    f"prompt {i} image {j}: {len(data)} base64 characters; at most {MAX_IMAGE_BASE64_CHARS}"
                )


def _open_checked(data: str, where: str, pixels_left: int) -> tuple[Any, int]:
    """The image of one base64 string, its header checked before its pixels are decoded; and its
    pixel count."""
    from PIL import Image, UnidentifiedImageError

    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageWireError(f"{where}: not base64 ({exc})") from exc
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw), formats=list(FORMATS))  # reads the header only
    except (
        UnidentifiedImageError,
        OSError,
        Image.DecompressionBombWarning,
        Image.DecompressionBombError,
    ) as exc:
        raise ImageWireError(f"{where}: not an image file of a format this server reads {FORMATS}") from exc
    width, height = image.size
    pixels = width * height
    if width < 1 or height < 1 or pixels > MAX_IMAGE_PIXELS:
        raise ImageWireError(f"{where}: {width}x{height} pixels; at most {MAX_IMAGE_PIXELS} per image")
    if pixels > pixels_left:
        raise ImageWireError(
            f"{where}: the request's images exceed {MAX_REQUEST_IMAGE_PIXELS} pixels together; split the request"
        )
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise ImageWireError(f"{where}: the image does not decode ({exc})") from exc
    return image.convert("RGB"), pixels


def decode_images(images: Sequence[Sequence[str]], prompts: int) -> list[list[Any] | None]:
    """The request's images as RGB PIL images, one list per prompt (None where a prompt has none),
    after `check_counts` and each image's header checks (see the module's docstring)."""
    check_counts(images, prompts)
    budget = MAX_REQUEST_IMAGE_PIXELS
    out: list[list[Any] | None] = []
    for i, prompt_images in enumerate(images):
        decoded = []
        for j, data in enumerate(prompt_images):
            image, pixels = _open_checked(data, f"prompt {i} image {j}", budget)
            budget -= pixels
            decoded.append(image)
        out.append(decoded or None)
    return out


__all__ = [
    "MAX_IMAGE_BASE64_CHARS",
    "MAX_IMAGES_PER_PROMPT",
    "EncodedImages",
    "ImageWireError",
    "check_counts",
    "decode_images",
    "encode_images",
]
