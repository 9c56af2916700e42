"""An adapter merged from tensors alone (`skylift.weight_sync.lora.merge`) equals PEFT's own
`merge_and_unload` of the same adapter, tensor by tensor, with and without rsLoRA; bad adapters
are refused with a clear error."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from skylift.weight_sync.lora.merge import merge_adapter

MODULES = ["q_proj", "v_proj", "down_proj", "lm_head"]


@pytest.mark.parametrize("rslora", [False, True])
def test_the_merge_equals_peft_merge_and_unload(tiny_model_dir: Path, rslora: bool) -> None:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, torch_dtype=torch.float32)
    config = LoraConfig(r=4, lora_alpha=8, target_modules=MODULES, use_rslora=rslora)
    peft_model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.05)  # a trained adapter: B is zero only at the start
    adapter = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    merged = merge_adapter(base, adapter, config.to_dict())
    reference = peft_model.merge_and_unload().state_dict()
    changed = [k for k in base if not torch.equal(merged[k], base[k])]
    assert len(changed) == 3 * len(model.model.layers) + 1  # q, v, down per layer and lm_head
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], rtol=0, atol=1e-6, msg=name)


def test_a_tied_unembedding_starts_from_the_embedding() -> None:
    embed = torch.randn(10, 4)
    a, b = torch.randn(2, 4), torch.randn(10, 2)
    adapter = {"base_model.model.lm_head.lora_A.weight": a, "base_model.model.lm_head.lora_B.weight": b}
    merged = merge_adapter({"model.embed_tokens.weight": embed}, adapter, {"r": 2, "lora_alpha": 4})
    torch.testing.assert_close(merged["lm_head.weight"], embed + 2.0 * b @ a)
    assert torch.equal(merged["model.embed_tokens.weight"], embed)  # the base is left alone


def test_bad_adapters_are_refused_naming_what_is_wrong() -> None:
    base = {"model.q_proj.weight": torch.zeros(3, 3)}
    half = {"base_model.model.model.q_proj.lora_A.weight": torch.zeros(1, 3)}
    with pytest.raises(ValueError, match="lacks lora_B"):
        merge_adapter(base, half, {"r": 1})
    stranger = {
        "base_model.model.model.k_proj.lora_A.weight": torch.zeros(1, 3),
        "base_model.model.model.k_proj.lora_B.weight": torch.zeros(3, 1),
    }
    with pytest.raises(KeyError, match="model.k_proj.weight"):
        merge_adapter(base, stranger, {"r": 1})
    with pytest.raises(ValueError, match="rank_pattern"):
        merge_adapter(base, {}, {"r": 1, "rank_pattern": {"q_proj": 2}})
