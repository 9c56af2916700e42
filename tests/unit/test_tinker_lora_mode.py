"""How a sampling engine chooses to serve LoRA samplers (`skylift.tinker.sampling.lora_mode`), over a fake
engine whose costs are set: the zero adapter covers the attention and MLP layers and changes
nothing; adapters win when two adapters' requests batched take no longer than a swap between them."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from tinker_fakes import FakeTransport

from skylift.tinker.sampling.lora_mode import calibrate, zero_adapter
from skylift.weight_sync.lora.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE

WEIGHTS = {
    "model.layers.0.self_attn.q_proj.weight": torch.randn(8, 6),
    "model.layers.0.mlp.down_proj.weight": torch.randn(6, 10),
    "model.layers.0.input_layernorm.weight": torch.ones(6),
    "model.embed_tokens.weight": torch.randn(20, 6),
}


class TimedEngine:
    """A request takes `adapter_s` under an adapter, `base_s` without; requests run at once."""

    def __init__(self, adapter_s: float, base_s: float) -> None:
        self.adapter_s, self.base_s = adapter_s, base_s
        self.loaded: set[str] = set()

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.loaded.add(name)

    async def unload_lora_adapter(self, name: str) -> None:
        self.loaded.remove(name)

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any]) -> None:
        """The LoRA transport's calls (`weight_sync.lora.calls`) onto the methods above."""
        assert transport == "lora", transport
        if operation == "load":
            await self.load_lora_adapter(payload["lora_name"], payload["lora_path"])
        else:
            await self.unload_lora_adapter(payload["lora_name"])

    async def generate(self, prompts: list[list[int]], params: Any, lora_name: str = "") -> list[Any]:
        assert not lora_name or lora_name in self.loaded
        await asyncio.sleep(self.adapter_s if lora_name else self.base_s)
        return []


def test_the_zero_adapter_covers_attention_and_mlp_and_changes_nothing(tmp_path: Path) -> None:
    folder = zero_adapter(WEIGHTS, 4, tmp_path / "zero")
    assert folder is not None
    config = json.loads((folder / ADAPTER_CONFIG_FILE).read_text())
    assert config["r"] == 4 and config["target_modules"] == ["down_proj", "q_proj"]
    tensors = load_file(str(folder / ADAPTER_WEIGHTS_FILE))
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.mlp.down_proj.lora_B.weight"]
    assert a.shape == (4, 6) and b.shape == (6, 4) and not b.any()
    assert len(tensors) == 4  # A and B of the two linear layers, nothing for norms or embeddings


def test_a_model_without_linear_layers_to_adapt_is_served_by_swaps() -> None:
    choice = asyncio.run(calibrate(TimedEngine(0, 0), FakeTransport(0), {"norm.weight": torch.ones(3)}, 8))
    assert choice.mode == "swap" and "no attention or MLP layers" in choice.reason


def test_adapters_win_when_batching_them_beats_a_swap() -> None:
    engine, sender = TimedEngine(adapter_s=0.02, base_s=0.01), FakeTransport(push_s=0.5)
    choice = asyncio.run(calibrate(engine, sender, WEIGHTS, 8))
    assert choice.mode == "adapters" and sender.pushes == 1 and not engine.loaded
    assert choice.adapters_s is not None and choice.swap_s is not None and choice.push_s is not None
    assert choice.adapters_s < choice.swap_s and choice.push_s <= choice.swap_s
    assert choice.report()["calibration"]["full_weight_push_s"] == choice.push_s


@pytest.mark.parametrize("unembed", [False, True])
def test_the_measured_choice_says_whether_unembedding_adapters_go_in_the_batch(unembed: bool) -> None:
    """An engine that takes adapters of the unembedding (Tinker's default `train_unembed`) and
    chose the batch serves them there (`EngineHost.serves_adapter`), not by swaps."""
    engine, sender = TimedEngine(adapter_s=0.02, base_s=0.01), FakeTransport(push_s=0.5)
    choice = asyncio.run(calibrate(engine, sender, WEIGHTS, 8, unembed=unembed))
    assert choice.mode == "adapters" and choice.unembed is unembed
    assert choice.report()["adapts_unembedding"] is unembed


def test_swaps_win_when_the_adapter_kernels_are_slower_than_a_push() -> None:
    choice = asyncio.run(
        calibrate(TimedEngine(adapter_s=0.6, base_s=0.01), FakeTransport(push_s=0.01), WEIGHTS, 8)
    )
    assert choice.mode == "swap" and "a swap between them" in choice.reason


def test_a_zero_adapter_of_a_tied_unembedding_takes_the_embedding_shape(tmp_path: Path) -> None:
    folder = zero_adapter(WEIGHTS, 4, tmp_path / "head", ("lm_head",))  # no lm_head.weight: tied
    assert folder is not None
    tensors = load_file(str(folder / ADAPTER_WEIGHTS_FILE))
    assert tensors["base_model.model.lm_head.lora_A.weight"].shape == (4, 6)
    assert tensors["base_model.model.lm_head.lora_B.weight"].shape == (20, 4)
    assert json.loads((folder / ADAPTER_CONFIG_FILE).read_text())["target_modules"] == ["lm_head"]


def test_unembedding_adapters_are_served_where_the_architecture_declares_them() -> None:
    from types import SimpleNamespace

    from skylift.tinker.sampling.lora_mode import accepts_unembed

    def engine(names: set[str] | Exception) -> SimpleNamespace:
        def module_names() -> set[str]:
            if isinstance(names, Exception):
                raise names
            return names

        return SimpleNamespace(lora=SimpleNamespace(module_names=module_names))

    assert accepts_unembed(engine({"qkv_proj", "lm_head", "embed_tokens"}))  # Llama's in vLLM 0.32
    assert not accepts_unembed(engine({"qkv_proj", "gate_up_proj"}))  # Qwen2's
    assert not accepts_unembed(engine(RuntimeError("unknown architecture")))


def test_the_choice_is_made_at_the_width_of_the_engines_batches() -> None:
    """Measured on the CPU (tinker_multi_lora.py): a request under an adapter runs at about half
    the speed of one without, so two samplers are served faster by a swap, four by the batch.
    The calibration runs as many adapters at once as one batch mixes (`--sampler-max-loras`)."""

    def choose(width: int) -> Any:
        engine, transport = TimedEngine(adapter_s=0.1, base_s=0.04), FakeTransport(push_s=0.01)
        choice = asyncio.run(calibrate(engine, transport, WEIGHTS, 8, width=width))
        assert transport.pushes == 1 and not engine.loaded  # one push measured, every adapter unloaded
        return choice

    two, four = choose(2), choose(4)
    assert two.mode == "swap" and four.mode == "adapters"
    assert four.report()["calibration"]["adapters"] == 4 and four.swap_s is not None
    assert four.swap_s >= 4 * 0.04 + 3 * 0.01  # four requests one after another, three pushes between
    assert choose(1).width == 2  # one adapter at a time is no choice to make: measured with two


def test_a_swap_counts_building_its_weights_as_the_swap_path_does(tmp_path: Path) -> None:
    """A LoRA sampler's swap reads the base and merges the adapter before the push: a calibration
    that leaves that out prefers swaps that cost more than it measured (tinker_multi_lora.py)."""
    from skylift.tinker.sampling.weights import merged_folder_into_base

    for name, tensor in WEIGHTS.items():  # the base on disk, as the swap path reads it
        save_file({name: tensor.contiguous()}, str(tmp_path / f"{name}.safetensors"))
    built: list[dict[str, torch.Tensor]] = []

    def swap_weights(folder: Path) -> dict[str, torch.Tensor]:
        time.sleep(0.1)  # a slow disk
        built.append(merged_folder_into_base(tmp_path, folder))
        return built[-1]

    def choose(swap: Any) -> Any:
        engine, transport = TimedEngine(adapter_s=0.12, base_s=0.04), FakeTransport(push_s=0.01)
        return asyncio.run(calibrate(engine, transport, WEIGHTS, 8, width=2, swap_weights=swap))

    assert choose(None).mode == "swap" and choose(None).merge_s is None  # 0.12 s against 0.09 s
    counted = choose(swap_weights)
    assert counted.mode == "adapters" and counted.merge_s is not None and counted.merge_s >= 0.1
    assert counted.swap_s is not None and counted.swap_s >= 2 * 0.04 + 0.1 + 0.01
    assert "weights built in" in counted.reason
    assert counted.report()["calibration"]["swap_weights_built_s"] == counted.merge_s
    # a zero adapter merged into the base is the base itself
    assert set(built[-1]) == set(WEIGHTS) and all(torch.equal(built[-1][n], WEIGHTS[n]) for n in WEIGHTS)
