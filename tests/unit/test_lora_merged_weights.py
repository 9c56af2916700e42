"""The merged weights a LoRA policy hands an engine (`skylift.worker.lora.merged_lora_weights`):
loaded into the plain base model they give the adapted model's logits, for a mixture-of-experts
model whose fused experts PEFT adapts as parameters as well as for a dense one."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3MoeConfig

from skylift.worker.lora import add_lora, lora_deltas, merged_lora_weights

SMALL = {
    "vocab_size": 64,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
}
CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, intermediate_size=48
    ),
    "llama": lambda: LlamaConfig(**SMALL, intermediate_size=48),
}


def _adapted(family: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    config = CONFIGS[family]()
    base = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    plain.load_state_dict(base.state_dict())
    wrapped = add_lora(base, rank=4, alpha=8, target_modules="all-linear", dropout=0.0, value_head=False)
    with torch.no_grad():  # a trained adapter: B is zero at init
        for name, param in wrapped.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    return wrapped, plain


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_merged_weights_give_the_adapted_models_logits(family: str) -> None:
    wrapped, plain = _adapted(family)
    tokens = torch.tensor([[3, 17, 42, 5, 60, 9, 1, 33]])
    with torch.no_grad():
        want = wrapped(tokens).logits
        before = plain(tokens).logits
        merged = dict(merged_lora_weights(wrapped))
        assert set(merged) == set(plain.state_dict())
        plain.load_state_dict(merged)
        got = plain(tokens).logits
    assert (want - before).abs().max() > 1e-2  # the adapter changes the model
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()


def test_the_fused_experts_of_a_moe_model_get_their_delta() -> None:
    wrapped, _ = _adapted("qwen3_moe")
    deltas = lora_deltas(wrapped)
    experts = sorted(k for k in deltas if ".experts." in k)
    # PEFT nests one wrapper per fused parameter: both reach their own state-dict name
    assert sorted(k.rsplit(".", 1)[-1] for k in experts) == [
        "down_proj",
        "down_proj",
        "gate_up_proj",
        "gate_up_proj",
    ]
    state = wrapped.state_dict()
    assert all(deltas[k].shape == state[k].shape for k in deltas)
