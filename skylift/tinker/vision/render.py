"""Rendering of image-bearing model inputs through anything that serves vLLM's chat render route.

A model input is a list of parts: token lists (encoded text) and `ImageInput`s. Each image is sent
as one chat message to ``/v1/chat/completions/render`` (concurrently, over one pooled client); the
answer's image placeholder span (``features.mm_placeholders.image``) gives the placeholder tokens
spliced in place of the image, and ``features.kwargs_data`` / ``mm_metadata`` carry the processed
``pixel_values`` and ``image_grid_thw`` the vision model trains on. The client's own text tokens
are kept as sent: for Qwen2-VL they carry ``<|vision_start|>`` / ``<|vision_end|>`` around the image.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from skylift.tinker.core.images import ImageInput
from skylift.tinker.errors import UserError

Part = list[int] | ImageInput


class RenderClient(Protocol):
    """Anything that serves vLLM's ``/v1/chat/completions/render`` (returns the response JSON).

    Satisfied by `skylift.tinker.vision.render_server.RenderServerClient` (the CPU render server), by the
    engine clients `skylift.inference.remote.RemoteInferenceEngine` / `EnginePool.from_urls`
    (servers started with ``--enable-scale-out``; the client spreads renders over its servers), and
    by `skylift.tinker.sampling.engine_host.EngineHost` (the Tinker service's in-process engine).
    """

    async def render_chat_completion(self, payload: dict[str, Any]) -> dict[str, Any]: ...


@dataclass
class RenderedImage:
    tokens: list[int]
    pixel_values: torch.Tensor  # [patches, channels * temporal_patch * patch * patch]
    image_grid_thw: torch.Tensor  # [3]


@dataclass
class RenderedInput:
    """Token ids with image placeholders spliced in, and the images' processed tensors."""

    tokens: list[int]
    pixel_values: torch.Tensor | None = None  # all images of the input, concatenated on dim 0
    image_grid_thw: torch.Tensor | None = None  # [num_images, 3]

    @property
    def has_images(self) -> bool:
        return self.pixel_values is not None


def has_images(parts: Sequence[Part]) -> bool:
    return any(isinstance(p, ImageInput) for p in parts)


def text_only(parts: Sequence[Part]) -> RenderedInput:
    tokens: list[int] = []
    for part in parts:
        if isinstance(part, ImageInput):
            raise ValueError("text_only() got an image part")
        tokens.extend(part)
    return RenderedInput(tokens=tokens)


def _decode_item(encoded: str | None) -> dict[str, torch.Tensor]:
    if encoded is None:
        return {}
    from vllm.entrypoints.scale_out.token_in_token_out.mm_serde import decode_mm_kwargs_item

    return {k: v for k, v in decode_mm_kwargs_item(encoded).get_data().items() if isinstance(v, torch.Tensor)}


def parse_render_response(response: dict[str, Any], image: ImageInput) -> RenderedImage:
    """The placeholder tokens and tensors of the single image of a chat render response."""
    features = response.get("features") or {}
    token_ids = response.get("token_ids") or []
    spans = (features.get("mm_placeholders") or {}).get("image") or []
    if len(spans) != 1:
        raise RuntimeError(f"render response has {len(spans)} image placeholders for one image")
    offset, length = int(spans[0]["offset"]), int(spans[0]["length"])
    if image.expected_tokens is not None and image.expected_tokens != length:
        raise UserError(
            f"{image.where}: expected_tokens={image.expected_tokens} but the image renders to {length} tokens"
        )
    data: dict[str, torch.Tensor] = {}
    for key in ("kwargs_data", "mm_metadata"):
        items = (features.get(key) or {}).get("image") or [None]
        data.update(_decode_item(items[0]))
    if "pixel_values" not in data or "image_grid_thw" not in data:
        raise RuntimeError(f"render response lacks pixel_values/image_grid_thw (got {sorted(data)})")
    return RenderedImage(
        tokens=list(token_ids[offset : offset + length]),
        pixel_values=data["pixel_values"].to(torch.float32),
        image_grid_thw=data["image_grid_thw"].reshape(-1).to(torch.int64),
    )


class VisionRenderer:
    """Renders image-bearing model inputs with a `RenderClient` for model `model_name`."""

    def __init__(self, client: RenderClient, model_name: str) -> None:
        self.client = client
        self.model_name = model_name

    async def render_image(self, image: ImageInput) -> RenderedImage:
        payload = {
            "model": self.model_name,
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image.data_url()}}]}
            ],
        }
        try:
            response = await self.client.render_chat_completion(payload)
        except UserError as exc:
            raise UserError(f"{image.where}: {exc}") from exc
        except Exception as exc:
            status = getattr(exc, "status", None)  # e.g. RemoteEngineError: a 4xx is the request's fault
            if isinstance(status, int) and 400 <= status < 500:
                raise UserError(f"{image.where}: {exc}") from exc
            raise
        return parse_render_response(response, image)

    async def render(self, parts: Sequence[Part]) -> RenderedInput:
        """One model input; text-only inputs make no request."""
        images = [p for p in parts if isinstance(p, ImageInput)]
        if not images:
            return text_only(parts)
        rendered = await asyncio.gather(*(self.render_image(img) for img in images))
        return splice(parts, rendered)

    async def render_many(self, inputs: Sequence[Sequence[Part]]) -> list[RenderedInput]:
        """Several model inputs; every image of every input is rendered concurrently."""
        return list(await asyncio.gather(*(self.render(parts) for parts in inputs)))


def splice(parts: Sequence[Part], rendered: Sequence[RenderedImage]) -> RenderedInput:
    """Concatenate text parts and the images' placeholder tokens in order."""
    tokens: list[int] = []
    pixel_values, grids = [], []
    images = iter(rendered)
    for part in parts:
        if isinstance(part, ImageInput):
            image = next(images)
            tokens.extend(image.tokens)
            pixel_values.append(image.pixel_values)
            grids.append(image.image_grid_thw)
        else:
            tokens.extend(part)
    if not grids:
        return RenderedInput(tokens=tokens)
    return RenderedInput(
        tokens=tokens, pixel_values=torch.cat(pixel_values), image_grid_thw=torch.stack(grids)
    )
