"""The base models a Tinker server serves, looked up by the name or the path a client sends."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass

from skylift.tinker.errors import UserError


@dataclass
class BaseModelInfo:
    name: str
    path: str
    max_model_len: int
    arch: str | None
    moe: bool = False  # a mixture of experts (its LoRA samplers take weight swaps)


def describe_base_model(name: str, max_model_len: int | None) -> BaseModelInfo:
    """Resolve `name` (registry name or directory) and read its context length and architecture."""
    from transformers import AutoConfig

    from skylift.models import resolve_model_path
    from skylift.models.moe import is_mixture_of_experts

    path = os.path.realpath(resolve_model_path(name))
    cfg = AutoConfig.from_pretrained(path)
    positions = getattr(cfg.get_text_config(), "max_position_embeddings", None) or 2048
    limit = max_model_len or min(int(positions), 4096)
    arch = (getattr(cfg, "architectures", None) or [None])[0]
    moe = is_mixture_of_experts(cfg)
    return BaseModelInfo(name=name, path=path, max_model_len=limit, arch=arch, moe=moe)


class BaseModels:
    """The served base models."""

    def __init__(self, names: list[str], max_model_len: int | None) -> None:
        if not names:
            raise ValueError("at least one --base-model is required")
        self.all = [describe_base_model(name, max_model_len) for name in names]

    def __iter__(self) -> Iterator[BaseModelInfo]:
        return iter(self.all)

    def get(self, name: str | None) -> BaseModelInfo:
        """The served base model `name` refers to (by name or by path)."""
        if not name:
            raise UserError("base_model is required")
        for info in self.all:
            if name == info.name:
                return info
        real = os.path.realpath(name) if os.path.exists(name) else None
        for info in self.all:
            if real == info.path:
                return info
        raise UserError(f"base model {name!r} is not served here; served: {[b.name for b in self.all]}")

    def for_path(self, model_path: str) -> BaseModelInfo:
        """The served base model stored at `model_path`."""
        real = os.path.realpath(model_path)
        for info in self.all:
            if info.path == real:
                return info
        raise UserError(f"model at {model_path} is not served here")

    def find_path(self, model_path: str) -> BaseModelInfo | None:
        real = os.path.realpath(model_path)
        return next((b for b in self.all if b.path == real), None)
