"""A vision-language model's image inputs in the trainer's forward passes.

A `SequenceBatch` of a vision-language run carries per row (`SequenceBatch.row_inputs`) the
``pixel_values`` and ``image_grid_thw`` of the images its image tokens stand for (the prompt's
and, in a multi-turn rollout, the observations', in order); a row without images has ``{}``. The
forward takes them concatenated in row order, with ``mm_token_type_ids`` marking the image
tokens, from which the model derives its multimodal positions. Rows selected into micro-batches
keep their own tensors (`SequenceBatch.select`). Such batches run the padded forward: the packed
(padding-free) and prefix-sharing paths score text rows only, so ``remove_microbatch_padding`` and
``share_prefixes`` fall back to padded micro-batches for them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from skylift.worker.batch import SequenceBatch


def is_vision_language(model_path: str) -> bool:
    """True for an image-text-to-text checkpoint (e.g. Qwen2-VL: its config has a vision_config)."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(model_path), "vision_config", None) is not None


def load_vision_language(path: str, dtype: torch.dtype) -> torch.nn.Module | None:
    """The image-text-to-text model of checkpoint `path`, or None for a text-only checkpoint."""
    if not is_vision_language(path):
        return None
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)


def image_token_count(grid_thw: Tensor, merge_size: int) -> int:
    """How many image tokens the images of `grid_thw` (`[images, 3]`) take in the ids."""
    return int((grid_thw.reshape(-1, 3).long().prod(-1) // (merge_size**2)).sum())


def check_rows(model: torch.nn.Module, batch: SequenceBatch) -> None:
    """`ValueError` naming the first row whose image tokens and image tensors disagree."""
    config = getattr(model, "config", None)
    image_token_id = getattr(config, "image_token_id", None)
    merge = getattr(getattr(config, "vision_config", None), "spatial_merge_size", 1) or 1
    if image_token_id is None or batch.row_inputs is None:
        return
    for i, row in enumerate(batch.row_inputs):
        found = int((batch.input_ids[i] == image_token_id).sum())
        grid = row.get("image_grid_thw")
        want = 0 if grid is None else image_token_count(grid, int(merge))
        if found != want:
            raise ValueError(f"batch row {i}: {found} image tokens but its images take {want}")


def vision_kwargs(model: torch.nn.Module, batch: SequenceBatch) -> dict[str, Tensor]:
    """The forward's image inputs: the rows' tensors concatenated in row order, and which
    positions hold image placeholders (the model derives its multimodal positions from them)."""
    check_rows(model, batch)
    rows = batch.row_inputs or []
    names = sorted({k for row in rows for k in row})
    kwargs = {k: torch.cat([row[k] for row in rows if k in row]) for k in names}
    image_token_id = getattr(getattr(model, "config", None), "image_token_id", None)
    if kwargs and image_token_id is not None:
        kwargs["mm_token_type_ids"] = (batch.input_ids == image_token_id).long()
    return kwargs


def row_inputs(per_row: list[dict[str, Tensor] | None]) -> list[dict[str, Tensor]] | None:
    """`SequenceBatch.row_inputs` of rows that may carry images (None when none does)."""
    if not any(per_row):
        return None
    return [dict(row or {}) for row in per_row]


__all__ = [
    "check_rows",
    "image_token_count",
    "is_vision_language",
    "load_vision_language",
    "row_inputs",
    "vision_kwargs",
]
