"""Rendering of Tinker model inputs into token ids.

A `ModelInput` is a list of chunks. Text chunks (already tokenized by the client) are concatenated
here, locally, without any inference engine: this is what keeps forward/backward free of engine
start-up. Image chunks need a multimodal processor and are refused with a clear user error.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from skylift.tinker.errors import UserError

IMAGE_CHUNK_TYPES = ("image", "image_asset_pointer")


def _image_error(where: str) -> UserError:
    return UserError(
        f"{where}: image chunks are not supported yet by this server (text-only models); "
        "send encoded_text chunks"
    )


def render_json_chunks(chunks: Sequence[dict[str, Any]], where: str = "model_input") -> list[int]:
    """Token ids of a JSON `ModelInput.chunks` list (`{"type": "encoded_text", "tokens": [...]}`)."""
    if not isinstance(chunks, list):
        raise UserError(f"{where}: chunks must be a list of chunk objects, got {type(chunks).__name__}")
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if not isinstance(chunk, dict):
            raise UserError(f"{where} chunk {i}: expected an object, got {type(chunk).__name__}")
        kind = chunk.get("type", "encoded_text")
        if kind in IMAGE_CHUNK_TYPES:
            raise _image_error(f"{where} chunk {i}")
        if kind != "encoded_text":
            raise UserError(f"{where} chunk {i}: unsupported chunk type {kind!r}")
        ids = chunk.get("tokens", [])
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise UserError(f"{where} chunk {i}: tokens must be a list of integer token ids")
        tokens.extend(ids)
    return tokens


def render_token_chunks(chunks: Iterable[list[int] | None], where: str = "model_input") -> list[int]:
    """Concatenate decoded chunks; `None` stands for a non-text chunk (refused)."""
    tokens: list[int] = []
    for i, chunk in enumerate(chunks):
        if chunk is None:
            raise _image_error(f"{where} chunk {i}")
        tokens.extend(chunk)
    return tokens


def check_token_range(tokens: Sequence[int], vocab_size: int, where: str) -> None:
    """Refuse token ids outside the model's vocabulary (they would crash the embedding)."""
    for t in tokens:
        if t < 0 or t >= vocab_size:
            raise UserError(f"{where}: token id {t} is outside the vocabulary [0, {vocab_size})")
