"""Recipes for the tiny mixture-of-experts models: ``tiny-qwen3-moe`` and ``tiny-mixtral``.

Both share the ``tiny-qwen2`` recipe's tokenizer (byte-level BPE, ChatML), sizes (hidden 128, head
size 32, 4 layers, untied, fp32) and seeded initialisation, with every MLP a sparse mixture of
experts routed top-2. They differ where MoE families differ on disk: Qwen3-MoE keeps 8 experts
under ``mlp.experts.N.{gate,up,down}_proj`` and its router at ``mlp.gate`` (the layout of Qwen2-MoE,
OLMoE, DeepSeek-V2/V3, GLM-4-MoE), Mixtral 4 experts under ``block_sparse_moe.experts.N.w1/w2/w3``
with its router at ``block_sparse_moe.gate``. transformers 5 fuses both into the same in-memory
layout (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``), so a weight sync has to convert
back (:mod:`skylift.models.checkpoint_names`). Two builds are byte-identical.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from skylift.models import tiny_qwen2

MOE_INTERMEDIATE_SIZE = 96
TOP_K = 2
QWEN3_MOE_EXPERTS = 8
MIXTRAL_EXPERTS = 4


def _common(vocab_size: int, eos_token_id: int, pad_token_id: int) -> dict[str, Any]:
    return dict(
        vocab_size=vocab_size,
        hidden_size=tiny_qwen2.HIDDEN_SIZE,
        num_hidden_layers=tiny_qwen2.NUM_LAYERS,
        num_attention_heads=tiny_qwen2.NUM_HEADS,
        num_key_value_heads=tiny_qwen2.NUM_KV_HEADS,
        head_dim=tiny_qwen2.HIDDEN_SIZE // tiny_qwen2.NUM_HEADS,
        max_position_embeddings=tiny_qwen2.MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        initializer_range=tiny_qwen2.INIT_STD,
        num_experts_per_tok=TOP_K,
    )


def qwen3_moe_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> Any:
    """The ``Qwen3MoeConfig`` of ``tiny-qwen3-moe``: every layer sparse, 8 experts, top-2."""
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        **_common(vocab_size, eos_token_id, pad_token_id),
        intermediate_size=tiny_qwen2.INTERMEDIATE_SIZE,
        moe_intermediate_size=MOE_INTERMEDIATE_SIZE,
        num_experts=QWEN3_MOE_EXPERTS,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        use_sliding_window=False,
    )


def mixtral_config(vocab_size: int, eos_token_id: int, pad_token_id: int) -> Any:
    """The ``MixtralConfig`` of ``tiny-mixtral``: 4 experts, top-2."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **_common(vocab_size, eos_token_id, pad_token_id),
        intermediate_size=MOE_INTERMEDIATE_SIZE,
        num_local_experts=MIXTRAL_EXPERTS,
        sliding_window=None,
    )


def build_moe(out_dir: Path, family: str) -> None:
    """Write the tiny MoE of `family` ("qwen3_moe" or "mixtral") into ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    tokenizer = tiny_qwen2.build_hf_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(tiny_qwen2.IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(tiny_qwen2.ENDOFTEXT)
    make_config = {"qwen3_moe": qwen3_moe_config, "mixtral": mixtral_config}[family]
    config = make_config(len(tokenizer), eos_token_id=eos_id, pad_token_id=pad_id)
    with torch.random.fork_rng(devices=[]):  # the default init would consume the caller's RNG
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tiny_qwen2.seeded_init_(model)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, max_length=tiny_qwen2.MAX_POSITIONS
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
