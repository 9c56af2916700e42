"""A run's vision-language set-up: the policy's image processing for the generator, the engine
arguments images need, and the checks that refuse, at start, what cannot run with images."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from skylift.config import ConfigError
from skylift.config.schema import SkyliftConfig
from skylift.generator.vision import VisionInputs, has_images
from skylift.inference.engine_args import VISION_ENGINE_ARGS
from skylift.inference.vllm_patches import qwen2_vl_site


def _rows_with_images(datasets: Iterable[Any]) -> str | None:
    """The uid of the first row with images in `datasets` (None: text only)."""
    for data in datasets:
        for sample in data or ():
            if has_images(sample.prompt):
                return str(sample.uid)
    return None


def run_vision(cfg: SkyliftConfig, model_path: str, datasets: Iterable[Any]) -> VisionInputs | None:
    """The policy's image processing (None: a text-only policy), after the checks:
    ``generator.vision_language_generator=true`` needs a vision-language policy, rows with images
    need one too."""
    vision = VisionInputs.load(model_path)
    if vision is None:
        if cfg.generator.vision_language_generator:
            raise ConfigError(
                f"generator.vision_language_generator=true but {cfg.trainer.policy.model.path} is not a "
                "vision-language model (its config has no vision_config)"
            )
        uid = _rows_with_images(datasets)
        if uid is not None:
            raise ConfigError(
                f"prompt {uid} has images but the policy {cfg.trainer.policy.model.path} is not a "
                "vision-language model"
            )
        return None
    # before any local engine starts (its processes inherit it); remote servers (`skylift serve`)
    # apply it themselves, and the images travel to them in /skylift/generate's body
    qwen2_vl_site.enable()
    return vision


def vision_engine_kwargs(vision: VisionInputs | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A local engine's arguments, with what a vision-language model's engine needs first."""
    return kwargs if vision is None else {**VISION_ENGINE_ARGS, **kwargs}


__all__ = ["run_vision", "vision_engine_kwargs"]
