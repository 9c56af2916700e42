"""Rendering and multimodal sampling with an in-process vLLM engine (`LocalVLLMEngine`).

Once a base model's engine is up, its own renderer (chat template, tokenizer, multimodal
processor of the `AsyncLLM`) serves the chat render route in-process: `EngineRenderer` wraps vLLM's
`ServingRender` (what the render server runs) around it, so the answer has the same shape as the
render server's. `generate_multimodal` samples from a prompt whose images are given as pictures:
each image's placeholder run is one ``<|image_pad|>`` token that vLLM expands again.

Call everything here on the engine's event loop.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

from skylift.inference.types import EngineError, GenerateOutput, SamplingParams
from skylift.tinker.core.images import ImageInput
from skylift.tinker.vision.render import Part


class EngineRenderer:
    """The chat render route of an `AsyncLLM`, in-process."""

    def __init__(self, async_llm: Any, model_name: str) -> None:
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIModelRegistry
        from vllm.entrypoints.scale_out.render.serving import ServingRender
        from vllm.renderers.online_renderer import OnlineRenderer

        model_config = async_llm.model_config
        online = OnlineRenderer(
            model_config=model_config,
            renderer=async_llm.renderer,
            request_logger=None,
            chat_template=None,
            chat_template_content_format="auto",
            trust_request_chat_template=False,
        )
        registry = OpenAIModelRegistry(
            model_config=model_config,
            base_model_paths=[BaseModelPath(name=model_name, model_path=model_name)],
        )
        self._serving = ServingRender(registry, online)

    async def render_chat_completion(self, payload: dict[str, Any]) -> dict[str, Any]:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.entrypoints.serve.engine.protocol import ErrorResponse

        from skylift.tinker.errors import UserError

        result = await self._serving.render_chat_request(ChatCompletionRequest(**payload))
        if isinstance(result, ErrorResponse):
            error = result.error
            if 400 <= int(error.code) < 500:
                raise UserError(f"render request failed (HTTP {error.code}): {error.message}")
            raise EngineError(f"engine render failed (HTTP {error.code}): {error.message}")
        return result.model_dump(mode="json")


def collapse_images(parts: Sequence[Part], image_token_id: int) -> tuple[list[int], list[Any]]:
    """Prompt token ids with one image token per image, and the images as PIL pictures."""
    from PIL import Image

    tokens: list[int] = []
    images = []
    for part in parts:
        if isinstance(part, ImageInput):
            tokens.append(image_token_id)
            images.append(Image.open(io.BytesIO(part.data)).convert("RGB"))
        else:
            tokens.extend(part)
    return tokens, images


async def generate_multimodal(
    engine: Any, prompt: list[int], images: list[Any], params: SamplingParams
) -> GenerateOutput:
    """Sample `params.n` continuations of a prompt with images from a `LocalVLLMEngine`."""
    outputs = await engine.generate([prompt], params, images=[images])
    return outputs[0]
