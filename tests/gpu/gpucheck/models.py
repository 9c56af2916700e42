"""The two models of the check, built on the machine that runs it, and the fixed batch they train on.

tiny-qwen2 comes from the project's builder (`skylift.models`). SmolLM2-135M's weights are too big
to travel, so its architecture is rebuilt from `SMOLLM2_135M` (the values of SmolLM2-135M-Instruct's
GGUF metadata, untied as `skylift models prepare smollm2-135m-instruct` unties it) with seeded random
weights. `layers` may be lowered for a quick CPU run; everything else stays SmolLM2's.
"""

from __future__ import annotations

from pathlib import Path

import torch

from skylift.worker.batch import SequenceBatch, build_sequence_batch

# SmolLM2-135M-Instruct (llama architecture), from its GGUF: llama.block_count, embedding_length, ...
SMOLLM2_135M = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0,
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "initializer_range": 0.02,
}
SEED = 1234


def tiny_qwen2_dir() -> Path:
    from skylift.models import prepare_model

    return prepare_model("tiny-qwen2")


def smollm2_dir(work: Path, layers: int) -> Path:
    """A float32 SmolLM2-135M-architecture checkpoint with random (seeded) weights under `work`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    out = work / f"smollm2-135m-random-{layers}l"
    if (out / "config.json").is_file() and any(out.glob("*.safetensors")):
        return out
    values = dict(SMOLLM2_135M, num_hidden_layers=layers)
    config = AutoConfig.for_model(values.pop("model_type"), **values)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def policy_batch(vocab_size: int, seed: int = SEED) -> SequenceBatch:
    """4 rows: 2 prompts x 2 responses (shared-prompt forward), ragged prompts and responses."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, vocab_size, (n,), generator=g).tolist()

    prompts = [ids(12), ids(9)]
    responses = [ids(n) for n in (16, 11, 14, 7)]
    return build_sequence_batch([prompts[0], prompts[0], prompts[1], prompts[1]], responses, pad_token_id=0)


def long_batch(vocab_size: int, rows: int, length: int, seed: int = SEED) -> SequenceBatch:
    """`rows` distinct prompts of `length // 4` tokens with responses of the rest (memory figures)."""
    g = torch.Generator().manual_seed(seed + 1)
    p = length // 4
    prompts = [torch.randint(3, vocab_size, (p,), generator=g).tolist() for _ in range(rows)]
    responses = [torch.randint(3, vocab_size, (length - p,), generator=g).tolist() for _ in range(rows)]
    return build_sequence_batch(prompts, responses, pad_token_id=0)
