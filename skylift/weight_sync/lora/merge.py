"""A PEFT LoRA adapter merged into its base model's weights, from tensors alone (no model built).

What a weight swap pushes for a LoRA sampler that only kept its adapter: every adapted linear
layer's ``W + s * B @ A`` (``s = lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with rsLoRA), the
other tensors as the base has them. An adapter of a tied unembedding (a base with no
``lm_head.weight``) starts from the token embedding's matrix, as the merged module's weight does.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

PEFT_PREFIX = "base_model.model."
UNEMBED_WEIGHT, EMBED_WEIGHT = "lm_head.weight", "model.embed_tokens.weight"


def merges_from_tensors(config: Mapping[str, Any]) -> bool:
    """Whether `merge_adapter` can merge an adapter of this ``adapter_config.json``: not one of
    parameters (PEFT's ``target_parameters``: a mixture of experts' fused 3-d experts, held in
    memory in another layout than the checkpoint's; merge those on the model instead,
    `skylift.worker.lora.merged_lora_weights`)."""
    return not config.get("target_parameters")


def adapter_scaling(config: Mapping[str, Any]) -> float:
    """The factor PEFT multiplies ``B @ A`` by (patterns of per-module ranks are refused)."""
    if config.get("rank_pattern") or config.get("alpha_pattern"):
        raise ValueError("merging adapters with rank_pattern / alpha_pattern is not supported")
    rank, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def merge_adapter(
    base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor], config: Mapping[str, Any]
) -> dict[str, torch.Tensor]:
    """`base` (Hugging Face names) with `adapter` (``adapter_model.safetensors``' names and
    tensors) merged in; the base's tensors are not modified."""
    if not merges_from_tensors(config):
        raise ValueError(
            f"the adapter adapts parameters ({', '.join(sorted(config['target_parameters']))}: fused "
            "experts, in memory in another layout than the checkpoint's): merge it on the model"
        )
    scaling = adapter_scaling(config)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapter.items():
        if name.startswith(PEFT_PREFIX) and name.endswith(".base_layer.weight"):
            continue  # PEFT saves an adapted embedding's base matrix by default: the base's own
        if not name.startswith(PEFT_PREFIX) or ".lora_" not in name:
            raise ValueError(f"not a PEFT LoRA tensor name: {name!r}")
        prefix, part = name[len(PEFT_PREFIX) :].rsplit(".lora_", 1)
        kind = part.split(".", 1)[0]
        if kind not in ("A", "B"):
            raise ValueError(f"{name}: only linear-layer adapters (lora_A / lora_B) can be merged")
        pairs.setdefault(prefix, {})[kind] = tensor
    merged = dict(base)
    for prefix, ab in pairs.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"adapter of {prefix!r} lacks lora_{'B' if 'A' in ab else 'A'}")
        target = f"{prefix}.weight"
        weight = base.get(target)
        if weight is None and target == UNEMBED_WEIGHT:
            weight = base.get(EMBED_WEIGHT)  # tied: the unembedding is the embedding's matrix
        if weight is None:
            raise KeyError(f"the adapter adapts {prefix!r}, which the base model's weights lack ({target})")
        delta = scaling * (ab["B"].float() @ ab["A"].float())
        if delta.shape != weight.shape:
            raise ValueError(f"{prefix}: adapter delta {tuple(delta.shape)} != weight {tuple(weight.shape)}")
        merged[target] = (weight.float() + delta).to(weight.dtype)
    return merged
