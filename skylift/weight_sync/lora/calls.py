"""The LoRA transport's calls on one engine, from its driver side: an adapter loaded from a
directory the engine can read, or unloaded (`weight_call("lora", ...)` of any engine client; the
engine half is `weight_sync.lora.engine`)."""

from __future__ import annotations

from skylift.weight_sync.engine_side import WeightCall


async def load_adapter(
    engine: WeightCall, name: str, path: str, *, activate: bool = False, load_inplace: bool = False
) -> None:
    """Load the PEFT adapter in directory `path` as `name` (`activate`: the engine's default)."""
    payload = {"lora_name": name, "lora_path": path, "activate": activate, "load_inplace": load_inplace}
    await engine.weight_call("lora", "load", payload)


async def unload_adapter(engine: WeightCall, name: str) -> None:
    await engine.weight_call("lora", "unload", {"lora_name": name})
