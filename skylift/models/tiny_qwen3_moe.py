"""Recipe for ``tiny-qwen3-moe`` (see :mod:`skylift.models.tiny_moe`)."""

from __future__ import annotations

from pathlib import Path

from skylift.models.tiny_moe import build_moe


def build(out_dir: Path) -> None:
    """Write the tiny Qwen3-MoE into ``out_dir``."""
    build_moe(out_dir, "qwen3_moe")
