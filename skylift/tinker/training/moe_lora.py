"""A LoRA client over a mixture-of-experts base: what its adapter covers, said at create time.

transformers 5 holds a layer's experts as fused 3-d parameters (``mlp.experts.gate_up_proj``:
experts x 2*intermediate x hidden, ``mlp.experts.down_proj``), not as ``nn.Linear`` layers, so the
names Tinker's ``train_mlp`` targets (``gate_proj``, ``up_proj``, ``down_proj``; Mixtral's
``w1``/``w3``/``w2``) name no module. PEFT maps them to ``target_parameters`` on the fused tensors
for the families it knows (its v4 -> v5 conversion: the Qwen2-MoE layout and Mixtral's): each
expert gets its own rank-r block (``gate_up_proj``'s rank doubled, gate and up fused). What the
wrapped model adapts is read back from it, not assumed: one log line per client names the modules
and parameters adapted and the routers (never adapted: Tinker's ``lora_config`` has no router
target). A ``train_mlp=True`` client whose experts PEFT left unadapted (a family it does not map)
is refused in one line rather than trained silently without them.
"""

from __future__ import annotations

from typing import Any

import torch

from skylift.tinker.errors import UserError
from skylift.worker.lora import lora_layers

#: Mixtral's expert names before transformers 5 fused them (what PEFT maps for that layout)
MIXTRAL_EXPERT_MODULES = ["w1", "w2", "w3"]


def _wrapped_parameters(model: torch.nn.Module) -> dict[str, int]:
    """State-dict name of each parameter a PEFT ``ParamWrapper`` adapts -> its rank per expert."""
    return {
        key: int(next(iter(layer.r.values())))
        for key, layer in lora_layers(model).items()
        if getattr(layer, "parameter_name", None) is not None and layer.r
    }


def _leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


def expert_adaptation(model: torch.nn.Module, train_mlp: bool) -> str:
    """What the LoRA-wrapped MoE `model` adapts, as one sentence; `UserError` when `train_mlp` asks
    for the experts and some fused expert tensor is not adapted."""
    wrapped = _wrapped_parameters(model)
    fused = [n for n, p in model.named_parameters() if p.dim() == 3 and ".lora_" not in n]
    missed = [n for n in fused if n not in wrapped]
    if train_mlp and missed:
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        raise UserError(
            f"train_mlp=True: the installed PEFT cannot adapt the fused experts of "
            f"{type(base).__name__} (e.g. {missed[0].replace('base_model.model.', '', 1)}: a 3-d "
            "parameter, not a linear layer); pass train_mlp=False to adapt attention and the "
            "unembedding only"
        )
    linear = sorted(
        {_leaf(n.rsplit(".lora_A.", 1)[0]) for n, _ in model.named_parameters() if ".lora_A." in n}
        - {"base_layer", "experts"}
    )
    parts = [f"linear layers {'/'.join(linear)}"] if linear else []
    if wrapped:
        ranks = sorted({_leaf(n): r for n, r in wrapped.items()}.items())
        per_expert = " and ".join(f"{leaf} at rank {r}" for leaf, r in ranks)
        parts.append(f"the experts (fused {per_expert} per expert, PEFT target_parameters)")
    else:
        parts.append("no experts (train_mlp=False)")
    return "adapts " + "; ".join(parts) + "; the routers are not adapted (frozen, as in the base)"


def describe(config: Any, model: torch.nn.Module, model_id: str) -> str:
    """The create-time line of a LoRA client `model_id` over the MoE base of `config`
    (a `ModelConfig`)."""
    return (
        f"LoRA client {model_id} (rank {config.lora_rank}) over the mixture of experts "
        f"{config.base_model}: {expert_adaptation(model, config.train_mlp)}"
    )


__all__ = ["MIXTRAL_EXPERT_MODULES", "describe", "expert_adaptation"]
