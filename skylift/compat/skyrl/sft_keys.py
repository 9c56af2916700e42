"""SkyRL's ``main_sft`` command lines on `skylift sft` (the SFT dialect, `skylift.config.sft`).

SkyRL's SFT configuration (``skyrl/train/config/sft_config.py``) is flat like skylift's, and most
keys have the same name and effect (``model.path``, ``model.lora.*``, ``train_datasets``,
``train_dataset_splits``, ``train_dataset_weights``, ``eval_datasets``, ``messages_key``,
``max_length``, ``num_steps``, ``batch_size``, ``micro_train_batch_size_per_gpu``,
``remove_microbatch_padding``, ``optimizer_config.*``, ``placement.*``, ``fsdp_config.*``,
``ckpt_*``, ``hf_save_interval``, ``dummy_run_*``). This dialect reads the rest:

- ``strategy=fsdp``/``fsdp2`` is skylift's only backend; ``strategy=megatron`` and any
  ``megatron_config.*`` key are refused with one message naming Megatron;
- the deprecated single-dataset keys (``dataset_name``, ``dataset_split``, ``eval_dataset_name``,
  ``eval_dataset_split``) and ``use_sample_packing`` become their list / new names;
- ``sampler=sequential`` is ``shuffle=false``; ``max_training_steps`` caps ``num_steps``;
- keys of SkyRL's data loading, caching and monitoring (`WITHOUT_EFFECT`) are set aside, with a
  warning when set to something other than SkyRL's default; what skylift cannot do is refused.
"""

from __future__ import annotations

import logging
from typing import Any

from skylift.config.errors import ConfigError
from skylift.config.sft import SFT_DIALECTS

logger = logging.getLogger("skylift.config")

RENAMED = {"use_sample_packing": "remove_microbatch_padding"}
AS_LIST = {
    "dataset_name": "train_datasets",
    "dataset_split": "train_dataset_splits",
    "eval_dataset_name": "eval_datasets",
    "eval_dataset_split": "eval_dataset_splits",
}

#: SkyRL key (a trailing ``*``: any key under it) -> (SkyRL's default, why it does nothing here)
WITHOUT_EFFECT: dict[str, tuple[Any, str]] = {
    "num_workers": (8, "tokenization runs in the driver"),
    "cache_dir": (None, "tokenized datasets are not cached"),
    "force_recache": (False, "tokenized datasets are not cached"),
    "disable_cache": (False, "tokenized datasets are not cached"),
    "enable_ray_gpu_monitor": (True, "no Ray GPU monitor"),
    "async_batch_collation": (True, "batches are built in the driver between steps"),
    "dataloader_num_workers": (0, "batches are built in the driver"),
    "dataloader_persistent_workers": (False, "batches are built in the driver"),
    "record_memory": (False, "no memory snapshots"),
    "use_torch_compile": (False, "no torch.compile of the logits"),
    "tags": (None, "wandb tags are not set"),
    "system_key": ("system", "a per-row system column is not read; put the system turn in messages"),
    "eval_dataset_names": (None, "eval losses are named by their dataset"),
    "model_config_kwargs*": (None, "overrides of the Hugging Face model config are not implemented"),
    "torch_profiler_config*": (None, "no torch profiler"),
    "fsdp_config.mixed_precision*": (None, "precision is bf16=true (autocast over float32 weights)"),
    "fsdp_config.wrap_policy*": (None, "skylift shards every decoder layer"),
    "model.lora.exclude_modules": (None, "LoRA targets model.lora.target_modules only"),
    "model.lora.init_method": ("kaiming", "PEFT's default LoRA initialisation"),
    "optimizer_config.offload_after_step": (True, "the optimizer state stays on the device"),
    "sequence_parallel_backend": ("ulysses", "Ulysses is the one sequence-parallel backend"),
}

#: SkyRL keys skylift refuses with a reason (any value but SkyRL's default).
REFUSED: dict[str, tuple[Any, str]] = {
    "pretokenized_dataset_paths": (None, "pretokenized datasets are not read: give chat datasets"),
    "eval_pretokenized_dataset_paths": (None, "pretokenized datasets are not read: give chat datasets"),
    "use_sequence_packing": (
        False,
        "controller-level bin packing is Megatron's; use remove_microbatch_padding",
    ),
    "sampler_class_path": (None, "custom samplers are not loaded"),
    "sampler_kwargs": ({}, "custom samplers are not loaded"),
}


def _match(table: dict[str, tuple[Any, str]], key: str) -> tuple[Any, str] | None:
    if key in table:
        return table[key]
    for pattern, entry in table.items():
        if pattern.endswith("*") and key.startswith(pattern[:-1]):
            return entry
    return None


def megatron_refusal(key: str, value: Any) -> str | None:
    if key.startswith("megatron") or (key == "strategy" and str(value).lower() == "megatron"):
        what = f"{key}={value}" if key == "strategy" else key
        return (
            f"skylift has no Megatron backend ({what} is refused): `skylift sft` trains with FSDP2 "
            "(strategy=fsdp); for large models use LoRA (model.lora.rank), CPU offload "
            "(fsdp_config.cpu_offload) or more ranks (placement.num_gpus_per_node)"
        )
    return None


@SFT_DIALECTS.register
def skyrl_sft_keys(pairs: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """SkyRL's ``main_sft`` keys as skylift's (see the module docstring)."""
    for key, value in pairs:
        message = megatron_refusal(key, value)
        if message is not None:
            raise ConfigError(message, key=key)
    out: list[tuple[str, Any]] = []
    cap: int | None = None
    for key, value in pairs:
        if key == "strategy":
            if str(value).lower() not in ("fsdp", "fsdp2"):
                raise ConfigError(
                    f"strategy={value!r}: `skylift sft` trains with FSDP2 (strategy=fsdp)", key=key
                )
            continue
        if key in RENAMED:
            out.append((RENAMED[key], value))
        elif key in AS_LIST:
            if value not in (None, ""):
                out.append((AS_LIST[key], [value]))
        elif key == "sampler":
            if value == "custom":
                raise ConfigError(
                    "sampler=custom: custom samplers are not loaded; use random or sequential", key=key
                )
            if value not in ("random", "sequential"):
                raise ConfigError(f"sampler={value!r} is not one of random, sequential", key=key)
            out.append(("shuffle", value == "random"))
        elif key == "max_training_steps":
            cap = None if value in (None, "") else int(value)
        elif key == "num_epochs" and value is None:
            continue
        elif key == "train_on_what" and value is not None:
            out.append((key, str(value)))
        elif (refused := _match(REFUSED, key)) is not None:
            default, why = refused
            if value not in (default, None, "", [], {}):
                raise ConfigError(f"{key}: {why}", key=key)
        elif (inert := _match(WITHOUT_EFFECT, key)) is not None:
            default, why = inert
            if value not in (default, None, "", [], {}):
                logger.warning("%s=%r has no effect in skylift: %s", key, value, why)
        else:
            out.append((key, value))
    if cap is not None:
        steps = next((v for k, v in reversed(out) if k == "num_steps" and v is not None), None)
        out.append(("num_steps", cap if steps is None else min(int(steps), cap)))
    return out


__all__ = ["REFUSED", "WITHOUT_EFFECT", "megatron_refusal", "skyrl_sft_keys"]
