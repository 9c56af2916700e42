"""Install a LoRA adapter received in memory into a vLLM worker's adapter manager, with no file.

vLLM's own path (`WorkerLoRAManager.add_adapter` -> `_load_adapter`) reads the adapter back from a
directory (`adapter_config.json` + `adapter_model.safetensors`). Here the adapter's tensors are
already in the worker (broadcast over the weight-update group), so the worker builds vLLM's
`LoRAModel` from them with `LoRAModel.from_lora_tensors` (what `from_local_checkpoint` ends in),
after the checks `_load_adapter` makes (the PEFT config against the engine's LoRA limits, every
tensor naming a module the engine serves with LoRA), then adds it to the manager's cache and
activates it, as `LRUCacheWorkerLoRAManager.add_adapter` does. It runs inside one `collective_rpc`,
between two engine steps: no forward pass sees a half-installed adapter.

An adapter installed this way lives only in the worker's adapter cache: vLLM cannot load it again
from its `lora_path`, so the engine keeps at most `max_cpu_loras` adapters while one of them is such
(`skylift.weight_sync.lora.engine`), and vLLM's LRU never evicts it. vLLM also drops every adapter
after a full-weight reload (`reset_lora_state`): an engine serving an in-memory adapter takes
adapter syncs only (skylift sends a LoRA policy's adapter, never merged weights).
"""

from __future__ import annotations

import time
from typing import Any

import torch


class LoraInstallError(ValueError):
    """The received adapter does not fit the engine (rank, target modules, capacity)."""


def _expected_modules(adapter_manager: Any) -> set[str]:
    """The module names an adapter may target on this model (packed modules by their parts)."""
    packed = adapter_manager.packed_modules_mapping
    expected: set[str] = set()
    for module in adapter_manager.supported_lora_modules:
        expected.update(packed.get(module, [module]))
        if module == "experts":
            expected.add(module)
    return expected


def _check_modules(
    lora_model_cls: Any,
    tensors: dict[str, torch.Tensor],
    expected: set[str],
    modules_to_save: list[str],
    weights_mapper: Any,
    skip_prefixes: list[str] | None,
) -> None:
    """Every tensor must belong to a module the engine serves with LoRA (vLLM's rule for a
    checkpoint; its base-embedding and skipped-prefix tensors are ignored)."""
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    unexpected: list[str] = []
    for name in tensors:
        if is_base_embedding_weights(name) or "base_layer" in name:
            continue
        if skip_prefixes and lora_model_cls._should_skip_module(name, skip_prefixes):
            continue
        module, _ = parse_fine_tuned_lora_name(name, weights_mapper)
        if ".experts" in module:
            ok = module[module.find(".experts") + 1 :] in expected
        else:
            base = module.rsplit(".", 1)[-1]
            ok = base in expected or base in modules_to_save
        if not ok:
            unexpected.append(module)
    if unexpected:
        raise LoraInstallError(
            f"the adapter targets modules this engine does not serve with LoRA: {sorted(set(unexpected))} "
            f"(expected target modules among {sorted(expected)})"
        )


def build_lora_model(
    manager: Any, lora_int_id: int, tensors: dict[str, torch.Tensor], peft_config: dict[str, Any]
) -> Any:
    """vLLM's `LoRAModel` of `tensors` with PEFT config `peft_config`, checked as vLLM checks an
    adapter it loads from disk. `manager`: the worker's `WorkerLoRAManager`."""
    from vllm.lora.peft_helper import PEFTHelper

    adapter_manager = manager._adapter_manager
    if getattr(adapter_manager, "moe_ep_load_spec", None) is not None:
        raise LoraInstallError("an in-memory LoRA sync does not serve expert-parallel MoE engines")
    try:
        peft_helper = PEFTHelper.from_dict(
            {**peft_config, "vllm_max_position_embeddings": manager.max_position_embeddings}
        )
        peft_helper.validate_legal(manager.lora_config)
    except (TypeError, ValueError) as exc:
        raise LoraInstallError(f"the adapter's PEFT config does not fit this engine: {exc}") from exc
    model = adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_rename_mapper()
    skip_prefixes = getattr(model, "lora_skip_prefixes", None)
    expected = _expected_modules(adapter_manager)
    lora_model_cls = manager._lora_model_cls
    _check_modules(
        lora_model_cls, tensors, expected, peft_helper.modules_to_save or [], mapper, skip_prefixes
    )
    lora = lora_model_cls.from_lora_tensors(
        lora_model_id=lora_int_id,
        tensors=tensors,
        peft_helper=peft_helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=skip_prefixes,
    )
    lora.is_3d_lora_weight = False
    adapter_manager._validate_moe_lora_format(lora)
    adapter_manager._validate_modules_to_save(lora)
    adapter_manager._validate_token_classification_lora(lora)
    return lora


def retire_adapters(manager: Any, lora_int_ids: list[int]) -> None:
    """Remove adapters from the worker's cache (ids it does not hold are skipped)."""
    for lora_int_id in lora_int_ids:
        manager._adapter_manager.remove_adapter(int(lora_int_id))


def install_lora_model(manager: Any, lora: Any) -> dict[str, float]:
    """Add `lora` to the worker's adapter cache and activate it (a LoRA slot gets its weights);
    the cache must have room. Returns the seconds of each part."""
    adapter_manager = manager._adapter_manager
    adapter_manager.remove_adapter(lora.id)  # an earlier adapter under this id (none: no-op)
    if len(adapter_manager) + 1 > adapter_manager.capacity:
        raise LoraInstallError(
            f"the engine's adapter cache is full ({len(adapter_manager)} adapters, max_cpu_loras="
            f"{adapter_manager.capacity}): unload one first"
        )
    start = time.perf_counter()
    adapter_manager.add_adapter(lora)  # packs q/k/v, gate/up; folds the scaling into lora_b
    added = time.perf_counter()
    adapter_manager.activate_adapter(lora.id)  # copies into a LoRA slot
    return {"add_s": added - start, "activate_s": time.perf_counter() - added}
