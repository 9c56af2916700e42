"""What makes a model a mixture of experts, read from its transformers config."""

from __future__ import annotations

from typing import Any


def is_mixture_of_experts(config: Any) -> bool:
    """Whether a transformers config is a mixture of experts (it routes each token to top-k experts)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "num_experts_per_tok", 0) or 0) > 0


__all__ = ["is_mixture_of_experts"]
