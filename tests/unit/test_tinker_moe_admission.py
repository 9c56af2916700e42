"""Admission's estimate of a LoRA client's adapter (`skylift.tinker.training.admission.lora_params`)
is exactly what PEFT creates: on a mixture of experts (Qwen3-MoE's and Mixtral's checkpoint names,
and fused 3-d expert tensors) per expert a rank-2r block on gate and up fused and a rank-r block on
down, as the create-time line reports; on a dense model every targeted linear layer at rank r."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3Config, Qwen3MoeConfig

from skylift.tinker.training.admission import TRAINED_BYTES, estimate, lora_params, weight_shapes
from skylift.tinker.training.moe_lora import MIXTRAL_EXPERT_MODULES
from skylift.tinker.training.trained_model import ModelConfig

SMALL: dict[str, Any] = dict(
    vocab_size=48,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    tie_word_embeddings=False,
)


def _model(family: str) -> Any:
    torch.manual_seed(0)
    if family == "qwen3_moe":
        config: Any = Qwen3MoeConfig(
            **SMALL, moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, mlp_only_layers=[]
        )
    elif family == "mixtral":
        config = MixtralConfig(**SMALL, intermediate_size=20, num_local_experts=3, num_experts_per_tok=2)
    else:
        config = Qwen3Config(**SMALL, intermediate_size=40)
    return AutoModelForCausalLM.from_config(config).float()


def _peft_count(model: Any, targets: list[str], rank: int) -> int:
    """The LoRA parameters PEFT creates with `targets` (as `TrainedModel.setup` passes them)."""
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=32, target_modules=targets))
    return sum(p.numel() for n, p in peft_model.named_parameters() if ".lora_" in n)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "dense"])
@pytest.mark.parametrize("train_mlp", [True, False])
def test_the_adapter_estimate_is_what_peft_creates(family: str, train_mlp: bool, tmp_path: Path) -> None:
    rank = 3
    model = _model(family)
    model.save_pretrained(tmp_path)
    config = ModelConfig(base_model=family, model_path=str(tmp_path), lora_rank=rank, train_mlp=train_mlp)
    targets = config.target_modules()
    moe = family != "dense"
    # what setup hands PEFT: Mixtral's expert names beside the MLP's on an MoE base
    real = _peft_count(model, targets + (MIXTRAL_EXPERT_MODULES if moe and train_mlp else []), rank)
    shapes = weight_shapes(str(tmp_path))
    assert lora_params(shapes, targets, rank) == real
    assert estimate(config).own_bytes == real * TRAINED_BYTES
    if moe and train_mlp:  # experts adapted: the old count (checkpoint names at rank r) was short
        assert any(".experts.0." in n for n in shapes)


def _fused(shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The same experts as fused 3-d tensors (``experts.gate_up_proj``: experts x 2I x H)."""
    out = {n: s for n, s in shapes.items() if ".experts." not in n}
    layers = {n.split(".experts.")[0] for n in shapes if ".experts." in n}
    for layer in layers:
        count = len({n.split(".")[-3] for n in shapes if n.startswith(f"{layer}.experts.")})
        gate, up, down = (
            shapes[f"{layer}.experts.0.{leaf}.weight"] for leaf in ("gate_proj", "up_proj", "down_proj")
        )
        out[f"{layer}.experts.gate_up_proj"] = (count, gate[0] + up[0], gate[1])
        out[f"{layer}.experts.down_proj"] = (count, *down)
    return out


def test_fused_expert_tensors_count_as_their_experts(tmp_path: Path) -> None:
    model = _model("qwen3_moe")
    model.save_pretrained(tmp_path)
    shapes = weight_shapes(str(tmp_path))
    fused = _fused(shapes)
    assert fused["model.layers.0.mlp.experts.gate_up_proj"] == (4, 48, 32)
    assert fused["model.layers.0.mlp.experts.down_proj"] == (4, 32, 24)
    targets = ModelConfig(base_model="m", model_path="", lora_rank=2).target_modules()
    assert lora_params(fused, targets, 2) == lora_params(shapes, targets, 2) == _peft_count(model, targets, 2)
