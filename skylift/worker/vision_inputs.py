"""A vision-language model's image inputs in the trainer's forward passes.

A `SequenceBatch` of a vision-language run carries per row (`SequenceBatch.row_inputs`) the
``pixel_values`` and ``image_grid_thw`` of the images its image tokens stand for (the prompt's
and, in a multi-turn rollout, the observations', in order); a row without images has ``{}``. The
forward takes them concatenated in row order, with ``mm_token_type_ids`` marking the image
tokens, from which the model derives its multimodal positions. Rows selected into micro-batches
keep their own tensors (`SequenceBatch.select`). Such batches run the padded forward: the packed
(padding-free) and prefix-sharing paths score text rows only, so ``remove_microbatch_padding`` and
``share_prefixes`` fall back to padded micro-batches for them. The engines never sample the image
and vision tokens (a logit bias); every forward (padded, packed, prefix tree) scores the same
biased distribution (`with_sampling_bias`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from skylift.worker.batch import SequenceBatch
from skylift.worker.routing_replay import ROUTED_EXPERTS


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


#: the bias the engines add to the logits of a vision-language model's banned tokens (vLLM's
#: ``logit_bias``, at its bound): they are never sampled, and the logprobs the engine returns are
#: those of the biased distribution, so the trainer scores the same one (`with_sampling_bias`)
BANNED_BIAS = -100.0


def banned_token_ids(config: Any) -> tuple[int, ...]:
    """The tokens a vision-language model's rollouts never sample: its image, video and
    vision-start tokens (one in a response would stand for an image that is not there); none for
    a text-only config."""
    if getattr(config, "vision_config", None) is None:
        return ()
    names = ("image_token_id", "video_token_id", "vision_start_token_id")
    return tuple(int(t) for t in (getattr(config, n, None) for n in names) if t is not None)


def with_sampling_bias(model: torch.nn.Module, logits: Tensor) -> Tensor:
    """`logits` (`[..., V]`) with `BANNED_BIAS` added at the model's banned tokens, as the engine
    sampled them (unchanged for a text-only model)."""
    banned = banned_token_ids(getattr(model, "config", None))
    if not banned:
        return logits
    bias = torch.zeros(logits.shape[-1], dtype=logits.dtype, device=logits.device)
    bias[list(banned)] = BANNED_BIAS
    return logits + bias


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


def has_images(batch: SequenceBatch) -> bool:
    """Whether a row of `batch` carries image inputs (its routed experts alone do not count)."""
    return any(set(row) - {ROUTED_EXPERTS} for row in batch.row_inputs or [])


def vision_kwargs(model: torch.nn.Module, batch: SequenceBatch) -> dict[str, Tensor]:
    """The forward's image inputs: the rows' tensors concatenated in row order, and which
    positions hold image placeholders (the model derives its multimodal positions from them)."""
    check_rows(model, batch)
    rows = batch.row_inputs or []
    names = sorted({k for row in rows for k in row} - {ROUTED_EXPERTS})
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
    "BANNED_BIAS",
    "banned_token_ids",
    "with_sampling_bias",
    "check_rows",
    "has_images",
    "image_token_count",
    "is_vision_language",
    "load_vision_language",
    "row_inputs",
    "vision_kwargs",
]
