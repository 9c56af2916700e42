"""LoRA adapters on a training worker's model (PEFT), and the merged weights an engine loads.

A policy or reference (head "lm") trains its adapters only. A critic (head "value") trains its
adapters and its whole value head: the head is new (no pretrained weights to adapt), so it gets no
adapter and stays trainable.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from skylift.worker.sharding import full_tensor

#: Attribute names of the scalar head of transformers' *ForTokenClassification models.
VALUE_HEADS = ("score", "classifier")


def value_head_name(model: torch.nn.Module) -> str:
    """The attribute holding a token-classification model's head."""
    for name in VALUE_HEADS:
        if isinstance(getattr(model, name, None), torch.nn.Module):
            return name
    raise ValueError(f"{type(model).__name__} has no value head (looked for {', '.join(VALUE_HEADS)})")


def add_lora(
    model: torch.nn.Module,
    *,
    rank: int,
    alpha: int,
    target_modules: list[str] | str,
    dropout: float,
    value_head: bool,
) -> Any:
    """`model` wrapped by PEFT with adapters of `rank` on `target_modules`; only they train, and,
    `value_head`, the head (see the module docstring)."""
    from peft import LoraConfig, get_peft_model

    head = value_head_name(model) if value_head else None
    config = LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=dropout,
        exclude_modules=[head] if head else None,
    )
    wrapped = get_peft_model(model, config)
    if head:
        getattr(model, head).requires_grad_(True)
    return wrapped


def merged_lora_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Base-model names with LoRA deltas merged in (what an inference engine needs)."""
    state = {k: full_tensor(v) for k, v in model.state_dict().items()}
    scaling: dict[str, float] = {}
    for name, module in model.named_modules():
        if hasattr(module, "scaling") and isinstance(module.scaling, dict):
            scaling[name] = float(next(iter(module.scaling.values())))
    for key, value in state.items():
        if "lora_" in key:
            continue
        clean = key.replace("base_model.model.", "", 1).replace(".base_layer", "")
        if key.endswith(".base_layer.weight"):
            prefix = key[: -len(".base_layer.weight")]
            a = next(
                (state[k] for k in state if k.startswith(prefix + ".lora_A.") and k.endswith("weight")), None
            )
            b = next(
                (state[k] for k in state if k.startswith(prefix + ".lora_B.") and k.endswith("weight")), None
            )
            if a is not None and b is not None:
                value = value + scaling.get(prefix, 1.0) * (b.float() @ a.float()).to(value.dtype)
        yield clean, value


__all__ = ["VALUE_HEADS", "add_lora", "merged_lora_weights", "value_head_name"]
