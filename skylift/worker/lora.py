"""LoRA adapters on a training worker's model (PEFT), and the merged weights an engine loads.

A policy or reference (head "lm") trains its adapters only. A critic (head "value") trains its
adapters and its whole value head: the head is new (no pretrained weights to adapt), so it gets no
adapter and stays trainable.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
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


@dataclass(frozen=True)
class _Adapted:
    """One LoRA layer of a PEFT model: where its A and B matrices are in the state dict, and how
    its delta is shaped (`experts` > 0: a wrapped 3-d expert parameter, PEFT's ``ParamWrapper``)."""

    lora_a: str
    lora_b: str
    scaling: float
    experts: int = 0
    out_first: bool = True  # the 3-d parameter is (experts, out, in), not (experts, in, out)


def _adapted_tensors(model: torch.nn.Module) -> dict[str, _Adapted]:
    """State-dict name of each adapted tensor -> its LoRA layer (the active adapter of each).

    A linear layer's adapter adds to ``<layer>.base_layer.weight``; an adapter of a parameter
    (PEFT's ``target_parameters``: a mixture of experts' fused ``gate_up_proj`` / ``down_proj``,
    wrapped once per parameter, the wrappers nested) adds to that parameter of the innermost
    module."""
    names = {id(module): name for name, module in model.named_modules()}
    adapted: dict[str, _Adapted] = {}
    for name, module in model.named_modules():
        scaling = getattr(module, "scaling", None)
        lora_a = getattr(module, "lora_A", None)
        if not isinstance(scaling, dict) or not isinstance(lora_a, torch.nn.ModuleDict) or not len(lora_a):
            continue
        adapter = next(iter(lora_a.keys()))
        a, b = f"{name}.lora_A.{adapter}.weight", f"{name}.lora_B.{adapter}.weight"
        parameter = getattr(module, "parameter_name", None)
        if parameter is None:
            adapted[f"{name}.base_layer.weight"] = _Adapted(a, b, float(scaling[adapter]))
            continue
        experts = int(getattr(module, "num_experts", 1))
        adapted[f"{names[id(module.get_base_layer())]}.{parameter}"] = _Adapted(
            a,
            b,
            float(scaling[adapter]),
            experts=experts if experts > 1 else 0,
            out_first=bool(getattr(module, "_did_swap_in_out_features", False)),
        )
    return adapted


def lora_delta(a: Tensor, b: Tensor, layer: _Adapted) -> Tensor:
    """``scaling * B @ A`` in the adapted tensor's shape (float32). For a 3-d expert parameter
    PEFT lays one rank-r block per expert out along A's rows (expert-major) and B's columns
    (expert-minor), as its ``ParamWrapper.get_delta_weight``."""
    a, b = a.float(), b.float()
    if not layer.experts:
        return layer.scaling * (b @ a)
    a3 = a.reshape(layer.experts, -1, a.shape[-1])  # experts x rank x in
    b3 = b.reshape(b.shape[0], -1, layer.experts)  # out x rank x experts
    layout = "e o i" if layer.out_first else "e i o"
    return layer.scaling * torch.einsum(f"o r e, e r i -> {layout}", b3, a3)


def merged_lora_weights(model: torch.nn.Module) -> Iterator[tuple[str, Tensor]]:
    """Base-model names with LoRA deltas merged in (what an inference engine needs): adapters of
    linear layers and of parameters (a mixture of experts' fused experts) alike, in the model's
    in-memory names and layouts (`skylift.models.checkpoint_names` turns them into the
    checkpoint's)."""
    state = {k: full_tensor(v) for k, v in model.state_dict().items()}
    adapted = _adapted_tensors(model)
    for key, value in state.items():
        if ".lora_" in key:
            continue
        layer = adapted.get(key)
        if layer is not None:
            delta = lora_delta(state[layer.lora_a], state[layer.lora_b], layer)
            value = (value.float() + delta).to(value.dtype)
        yield key.replace("base_model.model.", "", 1).replace(".base_layer", ""), value


__all__ = ["VALUE_HEADS", "add_lora", "lora_delta", "merged_lora_weights", "value_head_name"]
