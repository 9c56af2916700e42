"""LoRA adapters on a training worker's model (PEFT), and the merged weights an engine loads.

A policy or reference (head "lm") trains its adapters only. A critic (head "value") trains its
adapters and its whole value head: the head is new (no pretrained weights to adapt), so it gets no
adapter and stays trainable.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from skylift.worker.sharding import full_tensor, unsharded

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
    with warnings.catch_warnings():
        # PEFT 0.21 maps an MoE's fused experts to `target_parameters` and warns that its own
        # pattern for `gate_up_proj` (rank doubled) matched nothing, though it applied it
        warnings.filterwarnings(
            "ignore", message=r"The following (rank|alpha)_pattern keys", category=RuntimeWarning
        )
        wrapped = get_peft_model(model, config)
    if head:
        getattr(model, head).requires_grad_(True)
    return wrapped


def merged_lora_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Base-model names with every LoRA layer's delta merged in (what an inference engine needs):
    linear layers and the parameters PEFT adapts directly (a mixture-of-experts layer's fused
    experts) alike, each delta PEFT's own (`get_delta_weight`). A collective under FSDP2: every
    rank gathers the model and gets the same tensors."""
    with unsharded(model):
        deltas = lora_deltas(model)
    for key, value in model.state_dict().items():
        if "lora_" in key:
            continue
        value = full_tensor(value)
        if key in deltas:
            value = (value.float() + deltas.pop(key)).to(value.dtype)
        yield base_name(key), value
    if deltas:
        raise RuntimeError(f"LoRA deltas of parameters the state dict does not hold: {sorted(deltas)}")


def lora_layers(model: torch.nn.Module) -> dict[str, Any]:
    """Each PEFT LoRA layer of `model` (not merged) by the state-dict name of the parameter it
    adapts: a linear layer's ``<base_layer>.weight``, or the parameter a ``ParamWrapper`` wraps
    (an MoE's fused experts; nested wrappers each name their own). Named by module, as a tied
    weight has two names."""
    from peft.tuners.lora import LoraLayer

    names = {id(m): n for n, m in model.named_modules(remove_duplicate=False)}
    return {
        f"{names[id(module.get_base_layer())]}.{getattr(module, 'parameter_name', 'weight')}": module
        for module in model.modules()
        if isinstance(module, LoraLayer) and not module.merged
    }


def lora_deltas(model: torch.nn.Module) -> dict[str, Tensor]:
    """Each adapted parameter's LoRA delta (float32) by its state-dict name, summed over the active
    adapters; the model's parameters must be whole (not sharded)."""
    deltas: dict[str, Tensor] = {}
    for key, layer in lora_layers(model).items():
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                delta = layer.get_delta_weight(adapter).detach().float()
                deltas[key] = deltas[key] + delta if key in deltas else delta
    return deltas


def base_name(key: str) -> str:
    """A PEFT-wrapped model's tensor name as the base model names it."""
    return key.replace("base_model.model.", "", 1).replace(".base_layer", "")


__all__ = [
    "VALUE_HEADS",
    "add_lora",
    "base_name",
    "lora_deltas",
    "lora_layers",
    "merged_lora_weights",
    "value_head_name",
]
