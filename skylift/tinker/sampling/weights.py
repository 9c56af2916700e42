"""What a sampler samples from: full weights, a LoRA adapter over the base model, or both.

A sample request names its weights by a *tag* ("base", a sampler checkpoint's path, or
``ephemeral:<sampling session>``). `SamplerWeights` says how to get them: `full` loads merged
Hugging Face-named tensors (what a weight swap pushes), `adapter` the PEFT adapter (what an engine
serving many adapters at once loads into one of its slots). A LoRA client's sampler checkpoint
holds both (the merged weights, and the adapter in the `adapter/` folder); its ephemeral snapshot
holds only the adapter, merged into the base's weights (`merged_into_base`) only when a weight
swap needs them. Full fine-tuning and the base model have no adapter.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: the folder of a LoRA client's sampler checkpoint that holds its adapter in PEFT's layout
ADAPTER_DIR = "adapter"
#: the unembedding's module name in an adapter's ``target_modules``
UNEMBED = "lm_head"

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class AdapterSource:
    """A LoRA adapter in PEFT's layout: in a directory (a sampler checkpoint's) or in memory
    (an ephemeral snapshot's tensors); `config` is its `adapter_config.json` dict."""

    rank: int
    directory: Path | None = None
    tensors: Tensors | None = None
    config: dict[str, Any] | None = None

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.tensors or {})

    @property
    def unembed(self) -> bool:
        """Whether it adapts the unembedding (``lm_head``: Tinker's ``train_unembed``)."""
        return UNEMBED in ((self.config or {}).get("target_modules") or ())


@dataclass(frozen=True)
class SamplerWeights:
    """How to get the weights a tag names (see the module's docstring)."""

    tag: str
    full: Callable[[], Tensors] | None
    adapter: AdapterSource | None = None

    def load_full(self) -> Tensors:
        if self.full is None:
            raise RuntimeError(f"{self.tag}: only a LoRA adapter was kept for these weights, no full weights")
        return self.full()


@dataclass
class SamplerSnapshot:
    """An ephemeral sampler's weights held in memory: the adapter of a LoRA client, the merged
    full weights where they may be pushed (at least one of the two)."""

    full: Tensors | None
    adapter: AdapterSource | None = None

    @property
    def nbytes(self) -> int:
        return tensors_nbytes(self.full or {}) + (self.adapter.nbytes if self.adapter is not None else 0)


def tensors_nbytes(tensors: Tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def adapter_in(directory: Path) -> AdapterSource | None:
    """The adapter saved beside a sampler checkpoint's merged weights (None: the checkpoint has
    none: full fine-tuning, or written before adapters were saved)."""
    folder = directory / ADAPTER_DIR
    return peft_adapter(folder) if (folder / "adapter_config.json").is_file() else None


def peft_adapter(folder: Path) -> AdapterSource:
    """The adapter in a PEFT folder (``adapter_config.json`` and its weights)."""
    peft_config = json.loads((folder / "adapter_config.json").read_text())
    return AdapterSource(rank=int(peft_config["r"]), directory=folder, config=peft_config)


def load_safetensors_dir(directory: str | Path) -> Tensors:
    """Every tensor of the `*.safetensors` files in a Hugging Face model directory."""
    from safetensors.torch import load_file

    files = sorted(Path(directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {directory}")
    weights: Tensors = {}
    for f in files:
        weights.update(load_file(str(f)))
    return weights


def merged_into_base(base_dir: str | Path, adapter: AdapterSource) -> Tensors:
    """The base model's weights (from `base_dir`) with `adapter` merged in: what a weight swap
    pushes for a LoRA sampler that kept only its adapter."""
    from skylift.weight_sync.lora.adapter import ADAPTER_WEIGHTS_FILE
    from skylift.weight_sync.lora.merge import merge_adapter

    tensors = adapter.tensors
    if tensors is None:
        if adapter.directory is None:
            raise ValueError("an adapter needs its tensors or its directory")
        from safetensors.torch import load_file

        tensors = load_file(str(adapter.directory / ADAPTER_WEIGHTS_FILE))
    return merge_adapter(load_safetensors_dir(base_dir), tensors, adapter.config or {"r": adapter.rank})


def merged_folder_into_base(base_dir: str | Path, folder: Path) -> Tensors:
    """`merged_into_base` of the adapter in a PEFT folder."""
    return merged_into_base(base_dir, peft_adapter(folder))
