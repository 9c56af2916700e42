"""LoRA over a mixture of experts merged into the base weights (`skylift.worker.lora`): transformers 5
holds experts as fused 3-d parameters, which PEFT adapts with ``target_parameters`` (one rank-r
block per expert, its ``ParamWrapper``s nested on one experts module). The merge adds each
wrapper's delta as PEFT computes it, so a model loaded with the merged weights scores as the
adapted model does, also under the checkpoint's per-expert names; a tensors-only merge of such an
adapter is refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from skylift.models.checkpoint_names import CheckpointNames
from skylift.weight_sync.lora.merge import merge_adapter, merges_from_tensors
from skylift.worker.lora import merged_lora_weights

SMALL = dict(
    vocab_size=48,
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    num_experts_per_tok=2,
    tie_word_embeddings=False,
)
#: Tinker's default targets (attention, MLP, unembedding) with Mixtral's expert names
TARGETS = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
    "w1",
    "w2",
    "w3",
    "lm_head",
]


def small_moe(family: str) -> Any:
    torch.manual_seed(0)
    if family == "qwen3_moe":
        config: Any = Qwen3MoeConfig(**SMALL, moe_intermediate_size=24, num_experts=4, mlp_only_layers=[])
    else:
        config = MixtralConfig(**SMALL, intermediate_size=24, num_local_experts=3)
    return AutoModelForCausalLM.from_config(config).float().eval()


def adapted(family: str, rank: int = 2) -> Any:
    peft_model = get_peft_model(small_moe(family), LoraConfig(r=rank, lora_alpha=4, target_modules=TARGETS))
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # a trained adapter: B is zero only at the start
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    return peft_model


def logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_merged_weights_score_as_the_adapted_model(family: str) -> None:
    peft_model = adapted(family)
    wrappers = [m for m in peft_model.modules() if getattr(m, "parameter_name", None)]
    assert sorted({m.parameter_name for m in wrappers}) == ["down_proj", "gate_up_proj"]  # experts adapted
    merged = dict(merged_lora_weights(peft_model))
    base = peft_model.get_base_model()
    for wrapper in wrappers:  # each expert tensor moved by exactly PEFT's own delta
        inner = wrapper.get_base_layer()
        name = next(n for n, m in base.named_modules() if m is inner).replace(".base_layer", "")
        original = getattr(inner, wrapper.parameter_name)
        expected = original + wrapper.get_delta_weight("default")
        torch.testing.assert_close(merged[f"{name}.{wrapper.parameter_name}"], expected, rtol=0, atol=1e-6)
    plain = small_moe(family)
    assert set(merged) == set(plain.state_dict())  # the model's own in-memory names
    plain.load_state_dict(merged)
    ids = torch.tensor([[3, 17, 5, 41, 9, 22, 30, 7]])
    gap = (logits(plain, ids) - logits(peft_model, ids)).abs().max().item()
    unmerged = (logits(small_moe(family), ids) - logits(peft_model, ids)).abs().max().item()
    assert gap < 1e-5 < 1e-2 < unmerged, (gap, unmerged)


def test_the_merged_experts_reach_the_checkpoint_names_one_matrix_per_expert() -> None:
    peft_model = adapted("qwen3_moe")
    merged = dict(merged_lora_weights(peft_model))
    base = small_moe("qwen3_moe")
    out = dict(CheckpointNames(base).convert(merged.items()))
    delta = (
        merged["model.layers.1.mlp.experts.gate_up_proj"]
        - base.state_dict()["model.layers.1.mlp.experts.gate_up_proj"]
    )
    assert delta.abs().max() > 1e-3
    gate, up = merged["model.layers.1.mlp.experts.gate_up_proj"][2].chunk(2, dim=0)
    torch.testing.assert_close(out["model.layers.1.mlp.experts.2.gate_proj.weight"], gate)
    torch.testing.assert_close(out["model.layers.1.mlp.experts.2.up_proj.weight"], up)
    down = merged["model.layers.1.mlp.experts.down_proj"][3]
    torch.testing.assert_close(out["model.layers.1.mlp.experts.3.down_proj.weight"], down)


def test_a_tensors_only_merge_of_an_expert_adapter_is_refused_in_one_line() -> None:
    peft_model = adapted("qwen3_moe")
    config = peft_model.peft_config["default"].to_dict()
    assert not merges_from_tensors(config)
    assert merges_from_tensors(LoraConfig(r=2, target_modules=["q_proj"]).to_dict())
    adapter = get_peft_model_state_dict(peft_model)
    with pytest.raises(
        ValueError, match=r"adapts parameters \(down_proj, gate_up_proj: fused experts"
    ) as err:
        merge_adapter({}, adapter, config)
    assert "\n" not in str(err.value)
