"""LoRA-only weight sync: the policy's adapter, not the merged model, travels to the engines.

With `trainer.policy.model.lora.rank > 0` the engines serve the base model plus a named LoRA
adapter (vLLM's LoRA support), and a sync moves only the adapter's tensors, one of two ways:

- in memory: one bucket (`WeightBucket` wire format) broadcast over the existing weight-update
  group; each engine's workers receive it (`RPC_RECEIVE_LORA`, `lora.receiver`) and build vLLM's
  LoRA model from the received tensors (`lora.install`: no file), all in one engine round trip;
- through a directory (`generator.lora_sync_path`, a path the engines can read): rank 0 writes
  the adapter there in PEFT's layout (`adapter_model.safetensors` + `adapter_config.json`) and
  every engine loads it (vLLM's `/v1/load_lora_adapter` semantics).

Each sync publishes a new adapter under a new name (`LoraPublisher`), made the engines' default
for generation: a prefix-cache entry is keyed by the adapter's name, so blocks computed with old
adapter weights can never serve the new ones. The previous version stays loaded until the next
sync (requests still running with it, e.g. kept across an in-flight update, can finish); older
ones go first (in memory: in the same engine call that installs the new one, `retire`; through a
directory: unloaded before), so an engine holds at most two (`engine_args.LORA_SYNC_MAX_LORAS`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

import torch

from skylift.weight_sync.buckets import (
    NamedTensor,
    bucket_of,
    dtype_order,
    dtype_to_str,
    pack_bucket,
    tensor_nbytes,
)
from skylift.weight_sync.control import EngineGroup
from skylift.weight_sync.process_group import WeightSyncError, WeightSyncGroup
from skylift.weight_sync.protocol import WeightBucket, WeightSyncTarget

logger = logging.getLogger(__name__)

#: The receiver's method (on every vLLM worker, through ``collective_rpc``): receive one adapter.
RPC_RECEIVE_LORA = "skylift_receive_lora_adapter"

ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
ADAPTER_CONFIG_FILE = "adapter_config.json"

#: vLLM accepts these values of `max_lora_rank` (vllm.config.lora.MaxLoRARanks).
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


@dataclass
class LoraAdapterSpec:
    """An adapter to load: its name (what generation requests name) and PEFT's adapter config."""

    name: str
    peft_config: dict[str, Any] = field(default_factory=dict)
    #: make it the engine's default adapter (generation that names none samples with it)
    activate: bool = True
    #: adapters this one supersedes: unloaded in the same engine call (in-memory sync only)
    retire: list[str] = field(default_factory=list)


@dataclass
class LoraSyncStats:
    """What one adapter sync moved and how long it took."""

    name: str
    tensors: int
    bytes: int
    seconds: float
    mode: str  # "memory" | "directory"


def vllm_max_lora_rank(rank: int) -> int:
    """The smallest `max_lora_rank` vLLM accepts that holds an adapter of `rank`."""
    for allowed in VLLM_LORA_RANKS:
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above the largest rank vLLM serves ({VLLM_LORA_RANKS[-1]})")


def json_ready(config: dict[str, Any]) -> dict[str, Any]:
    """PEFT's config dict with sets (e.g. the resolved target modules) as sorted lists."""

    def fix(value: Any) -> Any:
        if isinstance(value, set | frozenset):
            return sorted(value)
        if isinstance(value, dict):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [fix(v) for v in value]
        if hasattr(value, "value") and type(value).__module__.startswith("peft"):
            return value.value  # PEFT's enums (task type, ...)
        return value

    return {k: fix(v) for k, v in config.items()}


def adapter_nbytes(named_tensors: Sequence[NamedTensor]) -> int:
    return sum(tensor_nbytes(t) for _, t in named_tensors)


def write_adapter_dir(
    directory: str, named_tensors: Sequence[NamedTensor], peft_config: dict[str, Any]
) -> str:
    """Write an adapter in PEFT's layout (what vLLM's LoRA loader reads); returns `directory`."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    tensors = {name: t.detach().contiguous().cpu() for name, t in named_tensors}
    save_file(tensors, os.path.join(directory, ADAPTER_WEIGHTS_FILE))
    with open(os.path.join(directory, ADAPTER_CONFIG_FILE), "w") as f:
        json.dump(json_ready(peft_config), f)
    return directory


def pack_adapter(named_tensors: Sequence[NamedTensor], device: torch.device) -> list[torch.Tensor]:
    """The flat wire buffers of `bucket_of(named_tensors)`. On CPU each tensor is copied into
    its dtype's buffer as bytes (numpy: one thread, no OpenMP): as fast as torch.cat on a quiet
    machine and much faster on a loaded one, where torch's threads wait on each other
    (benchmarks/RESULTS.md, lora_sync.py)."""
    if device.type != "cpu" or any(t.device.type != "cpu" for _, t in named_tensors):
        return pack_bucket(list(named_tensors), device)[1]
    buffers = []
    for dtype in dtype_order([dtype_to_str(t.dtype) for _, t in named_tensors]):
        parts = [
            t.detach().contiguous().reshape(-1) for _, t in named_tensors if dtype_to_str(t.dtype) == dtype
        ]
        flat = torch.empty(sum(p.numel() for p in parts), dtype=parts[0].dtype)
        out, offset = flat.view(torch.uint8).numpy(), 0
        for part in parts:
            raw = part.view(torch.uint8).numpy()
            out[offset : offset + raw.size] = raw
            offset += raw.size
        buffers.append(flat)
    return buffers


class LoraSource(Protocol):
    """Rank 0's half of an adapter sync: where the adapter's tensors are (`AdapterTensors` in this
    process; the policy's rank 0 in a training run, `cluster.engine_weights`)."""

    async def stage(self) -> tuple[WeightBucket, dict[str, Any]]:
        """Gather and pack the adapter for `broadcast`: its bucket metadata and PEFT config."""
        ...

    async def broadcast(self) -> int:
        """Broadcast the staged adapter over the weight-update group; the bytes sent."""
        ...

    async def write(self, directory: str) -> tuple[int, int]:
        """Write the adapter to `directory` in PEFT's layout: its tensor count and bytes."""
        ...


class AdapterTensors:
    """A `LoraSource` over tensors in this process, broadcast over `group` (rank 0 here)."""

    def __init__(
        self, named_tensors: Sequence[NamedTensor], peft_config: dict[str, Any], group: WeightSyncGroup | None
    ) -> None:
        self.tensors = [(name, t.detach()) for name, t in named_tensors]
        self.peft_config = peft_config
        self.group = group
        self._buffers: list[torch.Tensor] = []

    async def stage(self) -> tuple[WeightBucket, dict[str, Any]]:
        """Packed before the engines are called: they wait in the broadcast only for the wire."""
        assert self.group is not None
        self._buffers = await asyncio.to_thread(pack_adapter, self.tensors, self.group.device)
        return bucket_of(self.tensors), self.peft_config

    async def broadcast(self) -> int:
        assert self.group is not None
        buffers, self._buffers = self._buffers, []
        await asyncio.to_thread(broadcast_buffers, self.group, buffers)
        return sum(b.numel() * b.element_size() for b in buffers)

    async def write(self, directory: str) -> tuple[int, int]:
        write_adapter_dir(directory, self.tensors, self.peft_config)
        return len(self.tensors), adapter_nbytes(self.tensors)


def broadcast_buffers(group: WeightSyncGroup, buffers: Sequence[torch.Tensor]) -> None:
    for buf in buffers:
        group.broadcast(buf, src=0)


class LoraPublisher:
    """The policy's adapter on the engines (trainer rank 0): one new name per sync.

    Names are ``{prefix}-{run token}-v{n}``; the run token keeps a resumed run's names apart from
    adapters an earlier run left on remote engines. `keep_previous` superseded versions stay
    loaded (the rest are unloaded before a new one loads).
    """

    def __init__(self, prefix: str = "skylift-policy", keep_previous: int = 1) -> None:
        self.prefix = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.keep_previous = keep_previous
        self.version = 0
        # loaded versions, oldest first: (name, its directory under lora_sync_path, ours to delete)
        self._live: list[tuple[str, str | None]] = []

    @property
    def current(self) -> str | None:
        """The name of the newest version (the engines' default adapter)."""
        return self._live[-1][0] if self._live else None

    async def publish(
        self,
        engines: Sequence[WeightSyncTarget],
        named_tensors: Sequence[NamedTensor],
        peft_config: dict[str, Any],
        *,
        group: WeightSyncGroup | None = None,
        sync_path: str | None = None,
        timeout_s: float = 300.0,
    ) -> LoraSyncStats:
        """`publish_from` with the adapter's tensors in this process (rank 0 of `group` here)."""
        if not engines:
            raise WeightSyncError("LoRA sync: no engine to send the adapter to")
        if not sync_path and group is None:
            raise WeightSyncError("LoRA sync in memory needs the weight-update group (init_group)")
        targets = EngineGroup(engines, timeout_s=timeout_s, update_timeout_s=timeout_s)  # type: ignore[arg-type]
        return await self.publish_from(targets, AdapterTensors(named_tensors, peft_config, group), sync_path)

    async def publish_from(
        self, engines: EngineGroup, source: LoraSource, sync_path: str | None = None
    ) -> LoraSyncStats:
        """Load the adapter of `source` on every engine as their default under a new name
        (versions older than `keep_previous` leave): in memory over the weight-update group (the
        engines receive while `source` broadcasts), or through `sync_path` (`source` writes it)."""
        start = time.perf_counter()
        superseded = self._live[: max(0, len(self._live) - self.keep_previous)]
        del self._live[: len(superseded)]
        self.version += 1
        name = f"{self.prefix}-v{self.version}"
        directory: str | None = None
        if sync_path:
            for old, _ in superseded:
                await self._unload(engines, old)
            directory = os.path.join(sync_path, name)
            tensors, nbytes = await source.write(directory)
            await engines.each(
                f"load_lora_adapter ({name} from {directory})",
                lambda e: e.weight_call(
                    "lora", "load", {"lora_name": name, "lora_path": directory, "activate": True}
                ),
            )
        else:
            bucket, config = await source.stage()
            # the superseded versions leave in the engines' same call
            adapter = LoraAdapterSpec(
                name, json_ready(config), activate=True, retire=[o for o, _ in superseded]
            )
            tensors = len(bucket.names)
            nbytes, _ = await engines.with_rank_zero(
                f"LoRA adapter broadcast ({name})",
                source.broadcast(),
                f"receive_lora_adapter ({name}, {tensors} tensors)",
                lambda e: e.weight_call("lora", "receive", {**bucket.to_dict(), **asdict(adapter)}),
            )
        for _, old_dir in superseded:
            if old_dir is not None:
                shutil.rmtree(old_dir, ignore_errors=True)
        self._live.append((name, directory))
        mode = "directory" if sync_path else "memory"
        return LoraSyncStats(name, tensors, nbytes, time.perf_counter() - start, mode)

    async def _unload(self, engines: EngineGroup, name: str) -> None:
        """Unload a superseded adapter; an engine that cannot is logged, not raised."""
        results = await engines.each(
            f"unload_lora_adapter ({name})",
            lambda e: e.weight_call("lora", "unload", {"lora_name": name}),
            fail_fast=False,
        )
        for result in results:
            if isinstance(result, BaseException):
                logger.warning("LoRA sync: the previous adapter stays loaded: %s", result)


def cast_floating(named_tensors: Sequence[NamedTensor], dtype: torch.dtype | None) -> list[NamedTensor]:
    if dtype is None:
        return list(named_tensors)
    return [(n, t.to(dtype) if t.is_floating_point() else t) for n, t in named_tensors]
