"""A sampling engine's LoRA adapter slots (`skylift.tinker.sampling.adapter_slots`) and how `EngineHost`
serves LoRA samplers over them, with a fake engine: least recently used out first, never one a
request is using, a full table waits for a release, in-memory adapters are written for the engine
and deleted after; adapter samplers share the base without a weight push, full weights swap."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
from tinker_fakes import FakeTransport

from skylift.config.services import EngineSettings
from skylift.tinker.sampling.adapter_slots import AdapterSlots
from skylift.tinker.sampling.engine_host import EngineHost
from skylift.tinker.sampling.lora_mode import ModeChoice
from skylift.tinker.sampling.weights import AdapterSource, SamplerWeights, adapter_in
from skylift.weight_sync.lora.adapter import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, write_adapter_dir

CONFIG = {"peft_type": "LORA", "r": 4, "lora_alpha": 4, "target_modules": ["q_proj"]}


class FakeEngine:
    """What `AdapterSlots` and `EngineHost` call on a `LocalVLLMEngine`; records every call."""

    def __init__(self) -> None:
        self.loaded: dict[str, str] = {}
        self.calls: list[tuple[str, str]] = []

    async def load_lora_adapter(self, name: str, path: str) -> None:
        folder = Path(path)
        assert (folder / ADAPTER_CONFIG_FILE).is_file() and (folder / ADAPTER_WEIGHTS_FILE).is_file()
        self.loaded[name] = path
        self.calls.append(("load", name))

    async def unload_lora_adapter(self, name: str) -> None:
        del self.loaded[name]
        self.calls.append(("unload", name))

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any]) -> None:
        """The LoRA transport's calls (`weight_sync.lora.calls`) onto the methods above."""
        assert transport == "lora", transport
        if operation == "load":
            await self.load_lora_adapter(payload["lora_name"], payload["lora_path"])
        else:
            await self.unload_lora_adapter(payload["lora_name"])


def _memory_adapter() -> AdapterSource:
    tensors = {"base_model.model.q_proj.lora_A.weight": torch.ones(4, 8)}
    return AdapterSource(rank=4, tensors=tensors, config=CONFIG)


def test_the_least_recently_used_adapter_goes_first_and_comes_back_on_demand() -> None:
    async def go() -> tuple[FakeEngine, AdapterSlots, list[str]]:
        engine = FakeEngine()
        slots = AdapterSlots(engine, capacity=2)
        names = []
        for tag in ("a", "b", "a", "c", "b"):  # "a" used again before "c": "b" is the older one
            names.append(await slots.acquire(tag, _memory_adapter()))
            await slots.release(names[-1])
        return engine, slots, names

    engine, slots, names = asyncio.run(go())
    assert names[0] == names[2]  # a hit: the same slot, not loaded again
    assert engine.calls == [
        ("load", names[0]),
        ("load", names[1]),
        ("unload", names[1]),  # b, the least recently used, out for c
        ("load", names[3]),
        ("unload", names[0]),  # then a (c is newer) for b's return
        ("load", names[4]),
    ]
    assert slots.tags() == ["c", "b"]
    report = slots.report()
    assert (report["loads"], report["hits"], report["evictions"], report["in_use"]) == (4, 1, 2, 2)


def test_an_adapter_in_use_is_never_evicted_and_a_full_table_waits_for_a_release() -> None:
    async def go() -> tuple[FakeEngine, AdapterSlots, bool, str, str]:
        engine = FakeEngine()
        slots = AdapterSlots(engine, capacity=1)
        held = await slots.acquire("a", _memory_adapter())
        waiting = asyncio.create_task(slots.acquire("b", _memory_adapter()))
        await asyncio.sleep(0.05)
        blocked = not waiting.done()
        assert held in engine.loaded  # "a" generates on: not unloaded under it
        await slots.release(held)
        got = await asyncio.wait_for(waiting, 30)
        return engine, slots, blocked, held, got

    engine, slots, blocked, held, got = asyncio.run(go())
    assert blocked
    assert engine.calls == [("load", held), ("unload", held), ("load", got)]
    assert slots.report()["waits_for_a_slot"] == 1


def test_in_memory_adapters_are_written_for_the_engine_and_deleted_once_evicted(tmp_path: Path) -> None:
    """vLLM reads an adapter again from its path after a full-weight push dropped its cache: the
    scratch copy of an in-memory adapter lives as long as its slot."""
    on_disk = AdapterSource(rank=4, directory=Path(write_adapter_dir(str(tmp_path / "ckpt"), [], CONFIG)))

    async def go() -> tuple[FakeEngine, AdapterSlots, list[str]]:
        engine = FakeEngine()
        slots = AdapterSlots(engine, capacity=2)
        await slots.release(await slots.acquire("ephemeral:1", _memory_adapter()))
        await slots.release(await slots.acquire("tinker://run/sampler_weights/x", on_disk))
        loaded = list(engine.loaded.values())
        await slots.release(await slots.acquire("ephemeral:2", _memory_adapter()))  # evicts ephemeral:1
        return engine, slots, loaded

    engine, slots, (written, given) = asyncio.run(go())
    assert not Path(written).exists()  # evicted: the scratch copy is gone ...
    assert given == str(on_disk.directory) and Path(given).is_dir()  # ... a checkpoint's stays
    newest = engine.loaded[slots._loaded["ephemeral:2"]]
    assert Path(newest).is_dir()  # loaded and still in its slot: readable again
    slots.forget()
    assert slots.in_use() == 0 and not Path(newest).exists()


def test_slots_must_be_positive() -> None:
    with pytest.raises(ValueError, match="adapter slots must be >= 1, got 0"):
        AdapterSlots(FakeEngine(), capacity=0)


def test_a_sampler_checkpoint_names_its_adapter_rank(tmp_path: Path) -> None:
    assert adapter_in(tmp_path) is None  # full fine-tuning: merged weights only
    write_adapter_dir(str(tmp_path / "adapter"), [], {**CONFIG, "r": 16})
    found = adapter_in(tmp_path)
    assert found is not None and found.rank == 16 and found.directory == tmp_path / "adapter"


def _host(
    mode: str, max_lora_rank: int = 32, base_dir: str = "/nowhere"
) -> tuple[EngineHost, FakeEngine, FakeTransport]:
    settings = EngineSettings(lora_mode=mode, max_lora_rank=max_lora_rank)
    host = EngineHost("tiny", base_dir, settings)
    engine, sender = FakeEngine(), FakeTransport()
    host._engine, host._transport, host._tag = engine, sender, "base"  # as a start-up leaves them
    host.lora_mode = ModeChoice(mode, "test")
    if mode == "adapters":
        host.slots = AdapterSlots(engine, 2)
    return host, engine, sender


def _full(tag: str) -> SamplerWeights:
    return SamplerWeights(tag, lambda: {"w": torch.zeros(2)})


def _lora(tag: str, rank: int = 4) -> SamplerWeights:
    return SamplerWeights(tag, lambda: {"w": torch.ones(2)}, AdapterSource(rank, None, *_parts()))


def _parts() -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return {"base_model.model.q_proj.lora_A.weight": torch.ones(4, 8)}, CONFIG


def test_lora_samplers_share_the_base_while_others_generate_and_push_nothing() -> None:
    host, engine, sender = _host("adapters")

    async def go() -> tuple[str, str]:
        first = await host._acquire(_lora("ephemeral:alice"))  # alice is still generating ...
        second = await asyncio.wait_for(host._acquire(_lora("ephemeral:bob")), 30)  # ... bob starts
        await host._release(first)
        await host._release(second)
        return first, second

    first, second = asyncio.run(go())
    assert first != second and set(engine.loaded) == {first, second}
    assert sender.pushes == 0 and host._tag == "base"
    assert host.stats()["adapters"]["in_use"] == 2


def test_full_weights_and_oversized_ranks_take_the_swap_path(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.full((2,), 7.0)}, str(tmp_path / "model.safetensors"))  # the base, swapped back
    host, engine, sender = _host("adapters", max_lora_rank=8, base_dir=str(tmp_path))

    async def go() -> list[str]:
        names = []
        for weights in (_full("full-ft"), _lora("big", rank=16), _lora("small")):
            names.append(await host._acquire(weights))
            await host._release(names[-1])
        return names

    names = asyncio.run(go())
    assert names[:2] == ["", ""]  # swapped in: no adapter name
    assert names[2] != "" and sender.pushes == 3  # full-ft, big's merged weights, the base back


def test_in_swap_mode_a_lora_sampler_swaps_its_merged_weights() -> None:
    host, engine, sender = _host("swap")

    async def go() -> str:
        name = await host._acquire(_lora("ephemeral:alice"))
        await host._release(name)
        return name

    assert asyncio.run(go()) == "" and sender.pushes == 1 and host._tag == "ephemeral:alice"
    assert engine.calls == []


def test_an_unembedding_adapter_swaps_where_the_engine_takes_none(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    save_file({"w": torch.full((2,), 7.0)}, str(tmp_path / "model.safetensors"))
    host, engine, sender = _host("adapters", base_dir=str(tmp_path))
    tensors, _ = _parts()
    head = SamplerWeights(
        "head",
        lambda: {"w": torch.ones(2)},
        AdapterSource(4, None, tensors, {**CONFIG, "target_modules": ["q_proj", "lm_head"]}),
    )
    assert not host.serves_adapter(head) and host.serves_adapter(_lora("plain"))

    async def go() -> list[str]:
        names = []
        for weights in (head, _lora("plain")):
            names.append(await host._acquire(weights))
            await host._release(names[-1])
        return names

    names = asyncio.run(go())
    assert names[0] == "" and names[1] != "" and sender.pushes == 2  # head's merged weights, then the base
    assert host.lora_mode is not None
    host.lora_mode.unembed = True  # an engine that takes them (Llama's): served as an adapter
    assert host.serves_adapter(head)


def test_an_unembedding_adapter_scores_its_prompt_on_merged_weights(tmp_path: Path) -> None:
    """vLLM 0.32 leaves an lm_head adapter out of prompt logprobs (CUDA) or dies on them (CPU):
    a request that scores its prompt with such an adapter takes the swap path; its plain sampling
    requests, and any request of an adapter that leaves the unembedding alone, stay in the batch."""
    from safetensors.torch import save_file

    save_file({"w": torch.full((2,), 7.0)}, str(tmp_path / "model.safetensors"))
    host, engine, sender = _host("adapters", base_dir=str(tmp_path))
    assert host.lora_mode is not None
    host.lora_mode.unembed = True  # an engine that takes unembedding adapters (Llama's)
    tensors, _ = _parts()
    head = SamplerWeights(
        "head",
        lambda: {"w": torch.ones(2)},
        AdapterSource(4, None, tensors, {**CONFIG, "target_modules": ["q_proj", "lm_head"]}),
    )
    assert host.serves_adapter(head) and not host.serves_adapter(head, scores_prompt=True)
    assert host.serves_adapter(_lora("plain"), scores_prompt=True)

    async def go() -> list[str]:
        names = []
        for weights, scores in ((head, False), (head, True), (_lora("plain"), True)):
            names.append(await host._acquire(weights, scores_prompt=scores))
            await host._release(names[-1])
        return names

    sampled, scored, plain = asyncio.run(go())
    assert sampled != "" and scored == "" and plain != ""  # only the scoring request swapped ...
    assert sender.pushes == 2 and host._tag == "base"  # ... head's merged weights, then the base back
    assert host.stats()["prompt_scoring_swaps"] == 1
