"""Prompt rows with images, as SkyRL's and verl's vision datasets write them, as chat messages
whose content holds the images.

Two spellings, both read:

- an ``images`` column (a list: PIL images, paths, raw bytes, or ``{"bytes", "path"}`` dicts as HF
  datasets store images in parquet) and ``<image>`` placeholders in the messages' text, one per
  image in order (verl's geometry3k); a row with images and no placeholder gets them before the
  first user message's text;
- chat-content parts: ``{"type": "image", "image": ...}`` (or ``{"type": "image_url",
  "image_url": {"url": ...}}``) beside ``{"type": "text", "text": ...}``; a part without its own
  image takes the next one of the ``images`` column.

Either way a message with images becomes ``{"role", "content": [parts]}`` with every image part
``{"type": "image", "image": <RGB PIL image>}``: what chat templates of vision-language models
render (one image placeholder each) and what the generator hands the engine.
"""

from __future__ import annotations

from typing import Any

from skylift.utils.images import ImageError, load_image

PLACEHOLDER = "<image>"
IMAGES_COLUMN = "images"


class ImagePromptError(ValueError):
    """A prompt's images and its placeholders do not match (the message names the row)."""


def _text_parts(text: str, images: list[Any], where: str) -> list[dict[str, Any]]:
    pieces = text.split(PLACEHOLDER)
    parts: list[dict[str, Any]] = []
    for i, piece in enumerate(pieces):
        if i > 0:
            if not images:
                raise ImagePromptError(f"{where}: more {PLACEHOLDER} placeholders than images")
            parts.append({"type": "image", "image": images.pop(0)})
        if piece:
            parts.append({"type": "text", "text": piece})
    return parts


def _part(part: Any, images: list[Any], where: str) -> dict[str, Any]:
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise ImagePromptError(f"{where}: a content part must be a dict with a 'type', got {part!r:.80}")
    kind = part["type"]
    if kind == "text":
        return {"type": "text", "text": str(part.get("text") or "")}
    if kind not in ("image", "image_url"):
        raise ImagePromptError(f"{where}: content part type {kind!r} is not read (text, image, image_url)")
    value = part.get("image") if kind == "image" else part.get("image_url")
    if value is None or value == "":
        if not images:
            raise ImagePromptError(f"{where}: an image part has no image and the images column has none left")
        return {"type": "image", "image": images.pop(0)}
    return {"type": "image", "image": load_image(value, where)}


def image_messages(messages: list[dict[str, Any]], images: list[Any], where: str) -> list[dict[str, Any]]:
    """`messages` (role + content: text or parts) with `images` (raw values, in placeholder order)
    placed as image parts (see the module docstring); `ImagePromptError` when they do not match."""
    try:
        pending = [load_image(value, f"{where} image {i}") for i, value in enumerate(images)]
    except ImageError as exc:
        raise ImagePromptError(str(exc)) from exc
    total = len(pending)
    placed = any(PLACEHOLDER in m["content"] if isinstance(m["content"], str) else True for m in messages)
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message["content"]
        if isinstance(content, str):
            if PLACEHOLDER not in content and not (pending and not placed and message["role"] == "user"):
                out.append({"role": message["role"], "content": content})
                continue
            if not placed:  # no placeholder anywhere: the images open the first user message
                content = PLACEHOLDER * len(pending) + content
                placed = True
            parts = _text_parts(content, pending, where)
        else:
            try:
                parts = [_part(p, pending, where) for p in content]
            except ImageError as exc:
                raise ImagePromptError(str(exc)) from exc
        out.append({"role": message["role"], "content": parts})
    if pending:
        raise ImagePromptError(
            f"{where}: {total} image(s) but {total - len(pending)} {PLACEHOLDER} placeholder(s) or image part(s)"
        )
    return out


def has_image_parts(messages: list[dict[str, Any]]) -> bool:
    return any(not isinstance(m.get("content"), str) for m in messages)


__all__ = ["IMAGES_COLUMN", "PLACEHOLDER", "ImagePromptError", "has_image_parts", "image_messages"]
