"""Parsing of Tinker model inputs into parts: token lists and images.

A `ModelInput` is a list of chunks. Text chunks (already tokenized by the client) become token
lists; ``image`` / ``image_asset_pointer`` chunks become checked `ImageInput`s. Text-only inputs are
rendered here, locally, without any server (this keeps forward/backward free of start-ups); inputs
with images go through `skylift.tinker.vision.render` (a render server or the engines).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from skylift.tinker.core.images import ImageInput, image_from_json
from skylift.tinker.errors import UserError

IMAGE_CHUNK_TYPES = ("image", "image_asset_pointer")

Part = list[int] | ImageInput


def json_parts(
    chunks: Sequence[dict[str, Any]], where: str = "model_input", media_roots: Sequence[Path] = ()
) -> list[Part]:
    """The parts of a JSON `ModelInput.chunks` list, in order (images read and checked; image
    pointers only under `media_roots`). Blocking: images are decoded here."""
    if not isinstance(chunks, list):
        raise UserError(f"{where}: chunks must be a list of chunk objects, got {type(chunks).__name__}")
    parts: list[Part] = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict):
            raise UserError(f"{where} chunk {i}: expected an object, got {type(chunk).__name__}")
        kind = chunk.get("type", "encoded_text")
        if kind in IMAGE_CHUNK_TYPES:
            parts.append(image_from_json(chunk, f"{where} chunk {i}", media_roots))
            continue
        if kind != "encoded_text":
            raise UserError(f"{where} chunk {i}: unsupported chunk type {kind!r}")
        ids = chunk.get("tokens", [])
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"{where} chunk {i}: tokens must be a list of integer token ids")
        parts.append(list(ids))
    return parts


def check_token_range(tokens: Sequence[int], vocab_size: int, where: str) -> None:
    """Refuse token ids outside the model's vocabulary (they would crash the embedding)."""
    for t in tokens:
        if t < 0 or t >= vocab_size:
            raise UserError(f"{where}: token id {t} is outside the vocabulary [0, {vocab_size})")
