"""Recipe for ``tiny-qwen2``: a deterministic ~1M-parameter Qwen2 causal LM with its own tokenizer.

The tokenizer is a byte-level BPE trained here on :mod:`skylift.models.tiny_corpus` with Qwen2's
pre-tokenizer (its split regex, then ``ByteLevel(use_regex=False)``), so ``AutoTokenizer`` reloads
it exactly; it speaks ChatML and ends turns with ``<|im_end|>``. The weights are random but seeded,
untied (vLLM's CPU backend does not refresh a tied ``lm_head`` on weight reload) and saved in fp32,
so two builds are byte-identical. Head size is 32, the smallest vLLM's CPU attention supports.
"""

from __future__ import annotations

from pathlib import Path

from skylift.models.tiny_corpus import build_corpus

SEED = 0
VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 352
NUM_LAYERS = 4
NUM_HEADS = 4
NUM_KV_HEADS = 2
MAX_POSITIONS = 2048
INIT_STD = 0.02

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Qwen2's pre-tokenizer pattern: contractions, letter runs, single digits, punctuation, whitespace.
QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)


def train_tokenizer():
    """Train the byte-level BPE tokenizer (a ``tokenizers.Tokenizer``) on the built-in corpus."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.trainers import BpeTrainer

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Special tokens are added whole by the trainer; keep them out of the merge statistics.
    texts = []
    for line in build_corpus(seed=SEED):
        for special in SPECIAL_TOKENS:
            line = line.replace(special, "\n")
        texts.append(line)
    tokenizer.train_from_iterator(texts, trainer=trainer)
    return tokenizer


def build_hf_tokenizer():
    """The trained tokenizer wrapped for transformers, with ChatML template and special tokens set."""
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITIONS,
        clean_up_tokenization_spaces=False,
        padding_side="left",
    )


def build_config(vocab_size: int, eos_token_id: int, pad_token_id: int):
    """The ``Qwen2Config`` of the tiny model."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        max_position_embeddings=MAX_POSITIONS,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        use_sliding_window=False,
        bos_token_id=None,
        eos_token_id=eos_token_id,
        pad_token_id=pad_token_id,
        initializer_range=INIT_STD,
    )


def seeded_init_(model, seed: int = SEED) -> None:
    """Overwrite every parameter deterministically: N(0, INIT_STD) matrices, zero biases, unit norms."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                values = torch.randn(param.shape, generator=generator, dtype=torch.float32) * INIT_STD
                param.copy_(values)


def build(out_dir: Path) -> None:
    """Write the tiny model (config, fp32 safetensors, tokenizer, generation config) into ``out_dir``."""
    import torch
    from transformers import GenerationConfig, Qwen2ForCausalLM

    tokenizer = build_hf_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    config = build_config(len(tokenizer), eos_token_id=eos_id, pad_token_id=pad_id)
    with torch.random.fork_rng(devices=[]):  # the default init would consume the caller's RNG
        model = Qwen2ForCausalLM(config).to(torch.float32)
    seeded_init_(model)
    model.generation_config = GenerationConfig(
        bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id, max_length=MAX_POSITIONS
    )
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
