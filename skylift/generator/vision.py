"""Images in rollouts of a vision-language model (Qwen2-VL's layout: one image token repeated per
merged patch, `pixel_values` and `image_grid_thw` from the model's image processor).

While a rollout runs, its ids hold ONE image token per image, as chat templates render an image
part (``<|vision_start|><|image_pad|><|vision_end|>``); the engine gets the rollout's images with
every request (the prompt's, then each observation's, in order) and expands each token itself.
Once the rollout is done, `VisionInputs.attach` expands the trajectory's ids as the model sees them
(each image token repeated ``t * h * w / merge**2`` times, the repeats untrained: loss mask 0,
logprob 0) and gives it the images' processed tensors (`Trajectory.vision_inputs`), which the
trainer's forward takes (`skylift.worker.vision_inputs`). A prompt's `n` samples share one
processing of its images; a single-turn trajectory's expanded prompt is checked against the
engine's own expansion. Sampling never picks an image, video or vision-start token
(`banned_tokens`, a logit bias): such a token in a response would stand for an image that is not
there. vLLM's returned logprobs are those of the biased distribution, and the trainer scores that
same distribution (`skylift.worker.vision_inputs.with_sampling_bias`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from skylift.generator.trajectory import Trajectory
from skylift.utils.images import load_image
from skylift.worker.vision_inputs import BANNED_BIAS, banned_token_ids


class VisionError(ValueError):
    """Images that do not fit a rollout (the message names the prompt)."""


def message_images(messages: Sequence[dict[str, Any]], where: str = "message") -> list[Any]:
    """The images of `messages`' content parts (``{"type": "image", "image": ...}`` or
    ``{"type": "image_url", "image_url": {"url": ...}}``), in order, as RGB PIL images."""
    images = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) or content is None:
            continue
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "image":
                images.append(load_image(part.get("image"), where))
            elif kind == "image_url":
                images.append(load_image(part.get("image_url"), where))
    return images


def generate_with_images(
    engine: Any,
    prompts: list[list[int]],
    params: Any,
    images: Sequence[Sequence[Any]],
    session_id: str | None = None,
) -> Any:
    """`engine.generate` of `prompts`, with `images` (one list per prompt) where any prompt has
    images; a text-only request otherwise (an engine without image support never sees the word)."""
    args = (prompts, params) if session_id is None else (prompts, params, session_id)
    if any(images):
        return engine.generate(*args, images=[list(i) for i in images])
    return engine.generate(*args)


def has_images(messages: Sequence[dict[str, Any]]) -> bool:
    return any(
        isinstance(part, dict) and part.get("type") in ("image", "image_url")
        for message in messages
        if not isinstance(message.get("content"), str | None)
        for part in message["content"]
    )


def printable_messages(messages: Sequence[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """`messages` with each image part as ``{"type": "image", "size": [width, height]}`` (what a
    JSON record or a report shows of it)."""
    if messages is None:
        return None
    out = []
    for message in messages:
        content = message.get("content")
        if not isinstance(content, str | None):
            content = [
                {"type": "image", "size": list(getattr(part.get("image"), "size", ()) or ())}
                if isinstance(part, dict) and part.get("type") in ("image", "image_url")
                else part
                for part in content
            ]
        out.append({**message, "content": content})
    return out


@dataclass
class VisionInputs:
    """A vision-language model's image processing, for the generator."""

    image_processor: Any
    image_token_id: int
    merge_size: int
    banned_tokens: tuple[int, ...] = ()  # image, video and vision-start tokens: never sampled
    #: per tuple of image objects (kept alive here, so their ids stay theirs): tensors, token counts
    _cache: dict[tuple[int, ...], tuple[tuple[Any, ...], dict[str, Any], list[int]]] = field(
        default_factory=dict, repr=False
    )

    @classmethod
    def load(cls, model_path: str) -> VisionInputs | None:
        """The model's image processing, or None for a text-only model."""
        from transformers import AutoConfig, AutoImageProcessor

        config = AutoConfig.from_pretrained(model_path)
        vision = getattr(config, "vision_config", None)
        if vision is None:
            return None
        image_token = getattr(config, "image_token_id", None)
        if image_token is None:
            raise VisionError(f"{model_path}: a vision-language config without image_token_id")
        return cls(
            image_processor=AutoImageProcessor.from_pretrained(model_path),
            image_token_id=int(image_token),
            merge_size=int(getattr(vision, "spatial_merge_size", 1) or 1),
            banned_tokens=banned_token_ids(config),
        )

    def logit_bias(self) -> dict[int, float]:
        """The engine's logit bias: the banned tokens are never sampled (the trainer scores the
        same biased distribution: `skylift.worker.vision_inputs.with_sampling_bias`)."""
        return {token: BANNED_BIAS for token in self.banned_tokens}

    def process(self, images: Sequence[Any]) -> tuple[dict[str, Any], list[int]]:
        """The images' ``pixel_values`` / ``image_grid_thw`` and each image's token count; the
        same image objects (a prompt's samples) are processed once until `forget`."""
        key = tuple(id(image) for image in images)
        hit = self._cache.get(key)
        if hit is not None:
            return hit[1], hit[2]
        out = self.image_processor(images=list(images), return_tensors="pt")
        grid = out["image_grid_thw"].reshape(-1, 3).long()
        counts = [int(n) for n in (grid.prod(-1) // (self.merge_size**2)).tolist()]
        tensors = {"pixel_values": out["pixel_values"].float(), "image_grid_thw": grid}
        self._cache[key] = (tuple(images), tensors, counts)
        return tensors, counts

    def forget(self) -> None:
        """Drop the processed images (after each generate call)."""
        self._cache.clear()

    def attach(
        self, tr: Trajectory, images: Sequence[Any], engine_prompt: Sequence[int] | None = None
    ) -> None:
        """Expand `tr`'s image tokens (one per image) and give it the images' tensors (see the
        module docstring); `engine_prompt`: the engine's expansion of the prompt, checked."""
        ids = list(tr.prompt_ids) + list(tr.response_ids)
        found = sum(1 for t in ids if t == self.image_token_id)
        if found != len(images):
            raise VisionError(
                f"prompt {tr.uid}: {found} image token(s) for {len(images)} image(s): the chat template "
                "must render one image placeholder per image part"
            )
        if not images:
            return
        tensors, counts = self.process(images)
        repeat = iter(counts)
        prompt: list[int] = []
        for t in tr.prompt_ids:
            prompt += [t] * (next(repeat) if t == self.image_token_id else 1)
        if engine_prompt is not None and list(engine_prompt) != prompt:
            raise VisionError(
                f"prompt {tr.uid}: the engine expanded its images to {len(engine_prompt)} prompt tokens, "
                f"the model's image processor to {len(prompt)}: their image settings differ"
            )
        _expand_response(tr, self.image_token_id, repeat)
        tr.prompt_ids = prompt
        tr.vision_inputs = tensors
        tr.images = []


def _expand_response(tr: Trajectory, image_token: int, repeat: Any) -> None:
    """Repeat each image token of `tr`'s response (an observation's image, untrained) as `repeat`
    says, with every per-token list and the turns' reward positions moved along."""
    ids: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] | None = None if tr.token_versions is None else []
    where: list[int] = []  # old response index -> new
    for i, t in enumerate(tr.response_ids):
        times = next(repeat) if t == image_token else 1
        where.append(len(ids) + times - 1)
        ids += [t] * times
        mask += [tr.loss_mask[i] if times == 1 else 0] * times
        logprobs += [tr.rollout_logprobs[i] if times == 1 else 0.0] * times
        if versions is not None and tr.token_versions is not None:
            versions += [tr.token_versions[i]] * times
    tr.response_ids, tr.loss_mask, tr.rollout_logprobs, tr.token_versions = ids, mask, logprobs, versions
    tr.turn_rewards = [(where[index], reward) for index, reward in tr.turn_rewards]


__all__ = [
    "VisionError",
    "VisionInputs",
    "generate_with_images",
    "has_images",
    "message_images",
    "printable_messages",
]
