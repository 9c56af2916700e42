"""Recipe for ``tiny-qwen2-vl``: a deterministic tiny Qwen2-VL (vision-language) model and processor.

The text side is the ``tiny-qwen2`` recipe's (same BPE tokenizer plus Qwen2-VL's vision special
tokens, same sizes, head size 32, untied, fp32); the vision tower is one small ViT block with
Qwen2-VL's 14x14 patches, temporal patch 2 and 2x2 spatial merge. The processor parts (image
processor, tokenizer, a Qwen2-VL chat template) are saved beside the weights, so vLLM and transformers load the
directory offline. The image processor keeps images small (at most 112x112 pixels, 16 placeholder
tokens) so tests stay cheap. Weights are random but seeded: two builds are identical.
"""

from __future__ import annotations

from pathlib import Path

from skylift.models import tiny_qwen2

VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
VISION_TOKENS = [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]

PATCH_SIZE = 14
MERGE_SIZE = 2
TEMPORAL_PATCH_SIZE = 2
VISION_EMBED_DIM = 64
VISION_HEADS = 2
VISION_DEPTH = 1
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112
# Three multimodal rotary sections (temporal, height, width) covering head_dim / 2 = 16 frequencies.
MROPE_SECTION = [4, 6, 6]

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' -}}"
    "{%- if message['content'] is string -%}{{- message['content'] -}}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part['type'] == 'text' -%}{{- part['text'] -}}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def build_tokenizer():
    """The tiny-qwen2 tokenizer with the Qwen2-VL vision tokens added as special tokens."""
    tokenizer = tiny_qwen2.build_hf_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": [tiny_qwen2.IM_START, *VISION_TOKENS]})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_image_processor():
    """Qwen2-VL's image processor (PIL backend: torchvision is not installed) for small images.

    Saved as ``preprocessor_config.json`` with type ``Qwen2VLImageProcessor``, so loaders pick
    whichever backend their environment has. (transformers' ``Qwen2VLProcessor`` itself cannot be
    built without torchvision: it insists on a video processor; see ``skylift.inference.vllm_patches.qwen2_vl_site``.)
    """
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    return Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
    )


def build_config(tokenizer):
    """The `Qwen2VLConfig` of the tiny model."""
    from transformers import Qwen2VLConfig

    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    eos_id = tokenizer.convert_tokens_to_ids(tiny_qwen2.IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(tiny_qwen2.ENDOFTEXT)
    text = {
        "vocab_size": len(tokenizer),
        "hidden_size": tiny_qwen2.HIDDEN_SIZE,
        "intermediate_size": tiny_qwen2.INTERMEDIATE_SIZE,
        "num_hidden_layers": tiny_qwen2.NUM_LAYERS,
        "num_attention_heads": tiny_qwen2.NUM_HEADS,
        "num_key_value_heads": tiny_qwen2.NUM_KV_HEADS,
        "max_position_embeddings": tiny_qwen2.MAX_POSITIONS,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "use_sliding_window": False,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "bos_token_id": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": MROPE_SECTION},
    }
    vision = {
        "depth": VISION_DEPTH,
        "embed_dim": VISION_EMBED_DIM,
        "num_heads": VISION_HEADS,
        "mlp_ratio": 2,
        "hidden_size": tiny_qwen2.HIDDEN_SIZE,
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }
    return Qwen2VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=ids[IMAGE_PAD],
        video_token_id=ids[VIDEO_PAD],
        vision_start_token_id=ids[VISION_START],
        vision_end_token_id=ids[VISION_END],
        tie_word_embeddings=False,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
    )


def build(out_dir: Path) -> None:
    """Write the tiny VLM (config, fp32 safetensors, processor, generation config) into ``out_dir``."""
    import torch
    from transformers import GenerationConfig, Qwen2VLForConditionalGeneration

    tokenizer = build_tokenizer()
    config = build_config(tokenizer)
    with torch.random.fork_rng(devices=[]):  # the default init would consume the caller's RNG
        model = Qwen2VLForConditionalGeneration(config).to(torch.float32)
    tiny_qwen2.seeded_init_(model)
    eos_id, pad_id = config.text_config.eos_token_id, config.text_config.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, max_length=tiny_qwen2.MAX_POSITIONS
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    build_image_processor().save_pretrained(out_dir)
