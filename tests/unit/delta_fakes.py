"""Fake parts of checkpoint-delta weight sync tests: a tiny Qwen2 as the trainer's model, its
training steps, and a vLLM stand-in whose workers load from a delta store into a dict."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from skylift.weight_sync.delta.apply import DeltaStore
from skylift.weight_sync.delta.format import BaseWeights, as_bytes
from skylift.weight_sync.protocol import RPC_LOAD_DELTA


def tiny_model(base: Path) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(config)
    model.save_pretrained(base, safe_serialization=True)  # the checkpoint both sides start from
    return model


def sent(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """What the policy's rank 0 publishes: its full tensors cast to the engines' dtype."""
    for name, tensor in model.state_dict().items():
        yield name, tensor.to(dtype) if tensor.is_floating_point() else tensor


def step(model: torch.nn.Module, names: list[str], seed: int) -> None:
    """A training step that changes exactly `names`."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in names:
                param.add_(torch.randn(param.shape, generator=gen) * 0.05)


class FakeVllm:
    """What `LocalVLLMEngine`'s delta sync uses of vLLM's AsyncLLM: `collective_rpc` to one worker
    that loads tensors of the store into `weights` (seeded with the base checkpoint, as vLLM loads
    it in `dtype`), and the prefix-cache reset (of a text-only model: `model_config`)."""

    model_config = SimpleNamespace(is_multimodal_model=False)

    def __init__(self, base: Path, dtype: torch.dtype = torch.bfloat16) -> None:
        index = BaseWeights(base)
        self.weights = {n: index.tensor(n).to(dtype) for n in index.index()}  # type: ignore[union-attr]
        self.dtype = dtype
        self.loads: list[list[str]] = []
        self.resets = 0

    async def collective_rpc(self, method: str, timeout: float, args: tuple) -> list[Any]:
        assert method == RPC_LOAD_DELTA
        store_dir, base_dir, names, run_id, version = args
        store = DeltaStore(store_dir, Path(base_dir) if base_dir else None)
        for name, tensor in store.tensors(names, run_id, version):
            self.weights[name] = tensor.to(self.dtype)
        self.loads.append(list(names))
        return [{"tensors": len(names), "bytes": 0}]

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        self.resets += 1
        return True

    def holds(self, model: torch.nn.Module) -> bool:
        """Whether the engine's weights are the model's, bit for bit (in the engine's dtype)."""
        return all(torch.equal(as_bytes(self.weights[n]), as_bytes(t)) for n, t in sent(model, self.dtype))

    async def pause_generation(self, mode: str = "keep") -> None:
        self.loads.append([f"pause {mode}"])

    async def update_weight_version(self, version: str) -> None:
        self.loads.append([f"label {version}"])

    async def resume_generation(self) -> None:
        self.loads.append(["resume"])
