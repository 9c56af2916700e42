"""Recipe for ``tiny-mixtral`` (see :mod:`skylift.models.tiny_moe`)."""

from __future__ import annotations

from pathlib import Path

from skylift.models.tiny_moe import build_moe


def build(out_dir: Path) -> None:
    """Write the tiny Mixtral into ``out_dir``."""
    build_moe(out_dir, "mixtral")
