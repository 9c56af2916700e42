"""The trainer's in-memory tensors under the checkpoint's names and layouts
(`skylift.models.checkpoint_names`): the tiny MoE recipes, the MoE families transformers fuses, a
vision-language model, and the one-line error for a tensor that has no checkpoint name."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

from skylift.models import prepare_model
from skylift.models.checkpoint_names import (
    CheckpointNames,
    UnmappedWeightError,
    checkpoint_names_for,
    checkpoint_tensor_names,
    layer_key,
)

TINY = dict(
    vocab_size=64,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=32,
    tie_word_embeddings=False,
)


def checkpoint_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(file), "pt") as handle:
            tensors.update({name: handle.get_tensor(name) for name in handle.keys()})
    return tensors


def perturbed(model: Any, seed: int) -> Any:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.01)
    return model


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    cache = tmp_path_factory.mktemp("moe_cache")
    return {name: prepare_model(name, cache_dir=cache) for name in ("tiny-qwen3-moe", "tiny-mixtral")}


@pytest.mark.parametrize("name", ["tiny-qwen3-moe", "tiny-mixtral"])
def test_tiny_moe_state_dict_becomes_its_checkpoint(
    moe_dirs: dict[str, Path], name: str, tmp_path: Path
) -> None:
    """The loaded model's fused experts convert back to exactly the checkpoint's tensors, by name,
    and a trained (perturbed) model's tensors reload into the same in-memory weights."""
    model_dir = moe_dirs[name]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    state = model.state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") and v.dim() == 3 for k, v in state.items())
    names = checkpoint_names_for(model, str(model_dir))
    assert not names.identity
    converted = dict(names.convert(state.items()))
    on_disk = checkpoint_tensors(model_dir)
    assert converted.keys() == on_disk.keys()
    assert all(torch.equal(converted[k], on_disk[k]) for k in on_disk)

    # another set of weights: the converted tensors, saved as a checkpoint, load back into them
    perturbed(model, seed=3)
    trained = {k: v.clone() for k, v in model.state_dict().items()}
    converted = dict(names.convert(trained.items()))
    assert converted.keys() == on_disk.keys()
    shutil.copy(model_dir / "config.json", tmp_path / "config.json")
    save_file({k: v.contiguous() for k, v in converted.items()}, str(tmp_path / "model.safetensors"))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(torch.equal(reloaded.state_dict()[k], v) for k, v in trained.items())


def _family_models() -> list[tuple[str, Any]]:
    from transformers import (
        DeepseekV3Config,
        Glm4MoeConfig,
        GptOssConfig,
        MixtralConfig,
        OlmoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    return [
        ("qwen3_moe", Qwen3MoeConfig(**TINY, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
        (
            "qwen2_moe (shared expert)",
            Qwen2MoeConfig(
                **TINY,
                moe_intermediate_size=32,
                shared_expert_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
            ),
        ),
        ("mixtral", MixtralConfig(**TINY, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2)),
        ("olmoe", OlmoeConfig(**TINY, intermediate_size=32, num_experts=4, num_experts_per_tok=2)),
        (
            "deepseek_v3 (shared experts, dense first layer)",
            DeepseekV3Config(
                **{**TINY, "num_key_value_heads": 2},
                intermediate_size=64,
                moe_intermediate_size=32,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                q_lora_rank=None,
                kv_lora_rank=32,
                qk_rope_head_dim=16,
                qk_nope_head_dim=16,
                v_head_dim=32,
            ),
        ),
        (
            "gpt_oss (fused gate_up, expert biases, sliding layers)",
            GptOssConfig(
                **TINY,
                intermediate_size=32,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
            ),
        ),
        (
            "glm4_moe (shared expert, dense first layer)",
            Glm4MoeConfig(
                **TINY,
                intermediate_size=64,
                moe_intermediate_size=32,
                n_routed_experts=4,
                n_shared_experts=1,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
            ),
        ),
    ]


@pytest.mark.parametrize("family,config", _family_models(), ids=[name for name, _ in _family_models()])
def test_moe_families_convert_to_what_save_pretrained_writes(
    tmp_path: Path, family: str, config: Any
) -> None:
    """One rule for every family: the converted names and tensors are those save_pretrained writes."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    converted = dict(
        CheckpointNames(loaded, checkpoint_tensor_names(tmp_path)).convert(loaded.state_dict().items())
    )
    on_disk = checkpoint_tensors(tmp_path)
    assert converted.keys() == on_disk.keys(), family
    assert all(torch.equal(converted[k], on_disk[k]) for k in on_disk), family


def test_dense_and_vision_language_models(tmp_path: Path) -> None:
    """A dense model passes as it is; a vision-language model's text layers go back from
    `model.language_model.` to the checkpoint's `model.`."""
    from transformers import AutoModelForImageTextToText

    dense_dir = prepare_model("tiny-qwen2", cache_dir=tmp_path)
    dense = AutoModelForCausalLM.from_pretrained(dense_dir)
    names = checkpoint_names_for(dense, str(dense_dir))
    assert names.identity
    assert [k for k, _ in names.convert(dense.state_dict().items())] == list(dense.state_dict())

    vl_dir = prepare_model("tiny-qwen2-vl", cache_dir=tmp_path)
    vl = AutoModelForImageTextToText.from_pretrained(vl_dir)
    converted = dict(checkpoint_names_for(vl, str(vl_dir)).convert(vl.state_dict().items()))
    assert converted.keys() == checkpoint_tensors(vl_dir).keys()
    assert "model.language_model.embed_tokens.weight" in vl.state_dict()


def test_unmappable_parameter_is_one_line_naming_it_and_the_model_class(moe_dirs: dict[str, Path]) -> None:
    """A model whose fused experts have no conversion (the sync's bug before: the fused tensor sent
    under its in-memory name) stops with one line naming the parameter and the model class."""
    model_dir = moe_dirs["tiny-qwen3-moe"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model._weight_conversions = []  # as if transformers had recorded no conversion
    names = checkpoint_names_for(model, str(model_dir))
    with pytest.raises(UnmappedWeightError) as info:
        list(names.convert(model.state_dict().items()))
    message = str(info.value)
    assert "\n" not in message
    assert "model.layers.0.mlp.experts.gate_up_proj" in message and "Qwen3MoeForCausalLM" in message
    assert "model.layers.0.mlp.experts.0.gate_proj.weight" in message  # what the checkpoint holds


def test_tensors_of_a_layer_are_converted_together_and_streamed_in_order(moe_dirs: dict[str, Path]) -> None:
    assert layer_key("model.layers.12.mlp.experts.gate_up_proj") == "model.layers.12"
    assert layer_key("lm_head.weight") == "lm_head.weight"
    model_dir = moe_dirs["tiny-mixtral"]
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = [k for k, _ in checkpoint_names_for(model, str(model_dir)).convert(model.state_dict().items())]
    layers = [layer_key(k) for k in out]
    # each layer's tensors come out together, in the state dict's order of layers
    assert layers == sorted(layers, key=lambda key: [layer_key(k) for k in model.state_dict()].index(key))
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in out
