"""The LoRA transport's engine half: the adapters an engine serves (load, replace, unload, receive
in memory) and the pick of one per generation request.

Operations (``weight_call("lora", operation, payload)``): ``load`` {lora_name, lora_path,
load_inplace?, activate?}, ``unload`` {lora_name}, ``receive`` (a `WeightBucket`'s fields plus a
`LoraAdapterSpec`'s: over the weight-update group the broadcast transport's ``join`` built).

An engine started with LoRA (`enable_lora`, `max_lora_rank`, `max_loras`; see
`engine_args.lora_engine_args`) serves its base model plus named adapters. Semantics follow
vLLM's `/v1/load_lora_adapter`: a name is loaded once (again only with `load_inplace`), from a
directory in PEFT's layout; an unknown name or a path without an adapter is an error.

Generation names an adapter with `lora_name`: None means the engine's default adapter (the one
a LoRA weight sync loaded last with `activate`; none: the base model), "" the base model.
Inside the HTTP server the table is vLLM's own (`OpenAIServingModels.lora_requests`), so vLLM's
OpenAI routes serve the same adapters (`model` = the adapter's name) and list them in /v1/models.

An adapter received in memory (`receive`) is built in the workers from the received tensors
(`skylift.weight_sync.lora.install`) and exists nowhere on disk: vLLM could not load it again if
its LRU cache evicted it, so while the table holds one, loading beyond the cache's size
(`max_cpu_loras`) is refused rather than letting vLLM evict.
"""

from __future__ import annotations

import itertools
import logging
import os
import tempfile
from typing import Any

from skylift.utils.calls import call_with_timeout
from skylift.utils.engine_errors import (
    EngineError,
    EngineNotFoundError,
    EngineRequestError,
    EngineStateError,
    EngineUnavailableError,
)
from skylift.weight_sync.broadcast.engine import require_group
from skylift.weight_sync.buckets import validate_bucket
from skylift.weight_sync.engine_side import EngineHost, EngineSide, Payload, WeightState, decode
from skylift.weight_sync.lora.adapter import ADAPTER_CONFIG_FILE, RPC_RECEIVE_LORA, LoraAdapterSpec
from skylift.weight_sync.protocol import WeightBucket

logger = logging.getLogger(__name__)


class LoraAdapterNotFoundError(EngineNotFoundError):
    """No adapter of that name is loaded, or no adapter lives at that path (HTTP 404)."""


#: the `lora_path` of an adapter received in memory (vLLM's request needs one; nothing is there)
IN_MEMORY_PATH = "skylift-in-memory-lora"


def in_memory_path(lora_name: str) -> str:
    """A path that names the adapter and says where it lives, should vLLM ever try to read it."""
    return os.path.join(tempfile.gettempdir(), IN_MEMORY_PATH, lora_name)


class LoraEngineSide(EngineSide):
    """The adapter table of one engine (in the server: vLLM's `OpenAIServingModels`' own)."""

    transport = "lora"

    def __init__(self, host: EngineHost, state: WeightState) -> None:
        super().__init__(host, state)
        self.operations = {"load": self._load_op, "unload": self._unload_op, "receive": self._receive_op}
        self._owner = host
        registry = host.lora_registry
        self._registry = registry
        self._requests: dict[str, Any] = registry.lora_requests if registry is not None else {}
        self._ids = itertools.count(1)
        self._in_memory: set[str] = set()  # adapters received in memory (in no directory)
        self.default: str | None = None
        #: seconds of each part of the last in-memory receive, per worker (`weight_sync.lora.install`)
        self.last_receive: list[dict[str, float]] = []

    async def _load_op(self, payload: Payload) -> None:
        await self.load(
            str(payload.get("lora_name") or ""),
            str(payload.get("lora_path") or ""),
            load_inplace=bool(payload.get("load_inplace")),
            activate=bool(payload.get("activate")),
        )

    async def _unload_op(self, payload: Payload) -> None:
        await self.unload(str(payload.get("lora_name") or ""))

    async def _receive_op(self, payload: Payload) -> None:
        fields = dict(payload)
        bucket_fields = {k: fields.pop(k, None) for k in ("names", "dtypes", "shapes")}
        bucket = decode(self._owner, "receive_lora_adapter", WeightBucket, bucket_fields)
        adapter = decode(self._owner, "receive_lora_adapter", LoraAdapterSpec, fields)
        await self.receive(bucket, adapter)

    @property
    def enabled(self) -> bool:
        config = getattr(self._owner.vllm_engine, "vllm_config", None)
        return getattr(config, "lora_config", None) is not None

    def names(self) -> list[str]:
        return list(self._requests)

    def _require_enabled(self, operation: str) -> None:
        if not self.enabled:
            raise EngineStateError(
                f"{self._owner.name}: {operation}: this engine was started without LoRA (engine args "
                "enable_lora=True and max_lora_rank >= the adapter's rank; the server: --enable-lora "
                "--max-lora-rank N)"
            )

    def request_for(self, lora_name: str | None) -> Any:
        """vLLM's `LoRARequest` for a generation request (None: the base model)."""
        name = self.default if lora_name is None else lora_name
        if not name:
            return None
        found = self._requests.get(name)
        if found is None:
            raise LoraAdapterNotFoundError(
                f"{self._owner.name}: generate: no LoRA adapter named {name!r} is loaded "
                f"(loaded: {sorted(self._requests) or 'none'})"
            )
        return found

    def module_names(self) -> set[str]:
        """The module names this engine's model takes adapters of (what vLLM checks a loaded
        adapter's against): its linear layers, and ``lm_head`` / ``embed_tokens`` only where the
        architecture declares LoRA of them (vLLM 0.32: Llama's does, Qwen2's does not)."""
        from vllm.model_executor.model_loader.utils import get_model_cls

        model_cls = get_model_cls(self._owner.vllm_engine.model_config)
        names = set(getattr(model_cls, "embedding_modules", None) or {})
        for packed, parts in (getattr(model_cls, "packed_modules_mapping", None) or {}).items():
            names.update([packed, *parts])
        return names

    def capacity(self) -> int:
        """How many adapters the workers' cache holds (vLLM's `max_cpu_loras`)."""
        config = self._owner.vllm_engine.vllm_config.lora_config
        return int(config.max_cpu_loras or config.max_loras)

    def _require_room(self, operation: str, leaving: int = 0, in_memory: bool = False) -> None:
        """Refuse a new adapter (`in_memory`: received in memory) that would make vLLM evict one
        from its cache while the table holds an in-memory one (vLLM cannot reload it from disk)."""
        held = len(self._requests) - leaving
        if (self._in_memory or in_memory) and held + 1 > self.capacity():
            raise EngineStateError(
                f"{self._owner.name}: {operation}: the engine holds {held} LoRA adapters, as many as its "
                f"cache (max_cpu_loras={self.capacity()}), and an adapter received in memory cannot be "
                f"reloaded from disk (in memory: {sorted(self._in_memory) or 'the new one'}): unload one first"
            )

    def _next_id(self) -> int:
        if self._registry is not None:
            return int(self._registry.lora_id_counter.inc(1))
        return next(self._ids)

    async def load(
        self, lora_name: str, lora_path: str, *, load_inplace: bool = False, activate: bool = False
    ) -> Any:
        """Load the adapter at `lora_path` (a directory the engine can read) as `lora_name`."""
        from vllm.lora.request import LoRARequest

        operation = f"load_lora_adapter({lora_name!r})"
        self._require_enabled(operation)
        if not lora_name or not lora_path:
            raise EngineRequestError(
                f"{self._owner.name}: Both 'lora_name' and 'lora_path' must be provided."
            )
        if lora_name in self._requests and not load_inplace:
            raise EngineRequestError(
                f"{self._owner.name}: The lora adapter '{lora_name}' has already been loaded. If you want "
                "to load the adapter in place, set 'load_inplace' to True."
            )
        if not os.path.isfile(os.path.join(lora_path, ADAPTER_CONFIG_FILE)):
            raise LoraAdapterNotFoundError(
                f"{self._owner.name}: {operation}: no LoRA adapter at {lora_path!r} (a directory with "
                f"{ADAPTER_CONFIG_FILE} and adapter_model.safetensors, as PEFT saves it)"
            )
        previous = self._requests.get(lora_name)
        if previous is None:
            self._require_room(operation)
        request = LoRARequest(
            lora_name=lora_name,
            lora_int_id=previous.lora_int_id if previous is not None else self._next_id(),
            lora_path=lora_path,
            load_inplace=load_inplace,
        )
        await self._add(operation, request)
        self._requests[lora_name] = request
        self._in_memory.discard(lora_name)
        if activate:
            self.default = lora_name
        if previous is not None:  # same name, new weights: cached prefixes were computed with the old
            await self._owner.try_reset_prefix_cache()
        logger.info("%s: loaded LoRA adapter %r from %s", self._owner.name, lora_name, lora_path)
        return request

    async def _add(self, operation: str, request: Any) -> None:
        from vllm.v1.engine.exceptions import EngineDeadError

        path = request.lora_path

        def failure(message: str, exc: Exception) -> Exception:
            if isinstance(exc, EngineDeadError):
                return EngineUnavailableError(f"{message}: the vLLM engine process died ({exc})")
            return EngineRequestError(f"{message}: vLLM cannot load the adapter at {path}: {exc}")

        await call_with_timeout(
            self._owner.name,
            operation,
            self._owner.vllm_engine.add_lora(request),
            self._owner.control_timeout_s,
            timeout_error=EngineUnavailableError,
            error=failure,
        )

    async def unload(self, lora_name: str) -> None:
        """Unload `lora_name` (and delete the directory this engine wrote for it, if any)."""
        if not lora_name:
            raise EngineRequestError(
                f"{self._owner.name}: 'lora_name' needs to be provided to unload a LoRA adapter."
            )
        request = self._requests.get(lora_name)
        if request is None:
            raise LoraAdapterNotFoundError(
                f"{self._owner.name}: The lora adapter '{lora_name}' cannot be found."
            )
        if self.enabled:
            await self._owner.call(
                f"unload_lora_adapter({lora_name!r})",
                self._owner.vllm_engine.remove_lora(request.lora_int_id),
                self._owner.control_timeout_s,
            )
        self._forget(lora_name)

    def _forget(self, lora_name: str) -> None:
        self._requests.pop(lora_name, None)
        self._in_memory.discard(lora_name)
        if self.default == lora_name:
            self.default = None

    async def receive(self, bucket: WeightBucket, adapter: LoraAdapterSpec) -> None:
        """Receive the adapter over the engine's weight-update group (under its `weight_lock`) and
        install it from the received tensors; the adapters it supersedes (`adapter.retire`) leave
        in the same engine call."""
        try:
            bucket = validate_bucket(bucket)
        except ValueError as exc:
            raise EngineRequestError(f"{self._owner.name}: receive_lora_adapter: {exc}") from exc
        async with self.state.lock:
            require_group(self._owner, self.state, "receive_lora_adapter")
            await self._receive(bucket, adapter)

    async def _receive(self, bucket: WeightBucket, adapter: LoraAdapterSpec) -> None:
        from vllm.lora.request import LoRARequest

        operation = f"receive_lora_adapter({adapter.name!r}, {len(bucket.names)} tensors)"
        retire = [name for name in dict.fromkeys(adapter.retire) if name in self._requests]
        try:
            self._require_enabled("receive_lora_adapter")
            if adapter.name in self._requests:
                raise EngineRequestError(
                    f"{self._owner.name}: receive_lora_adapter: an adapter named {adapter.name!r} is "
                    "already loaded; a new version needs a new name"
                )
            self._require_room(operation, leaving=len(retire), in_memory=True)
        except EngineError:
            # the sender is broadcasting: take the bucket in and drop it, so the group stays usable
            await self._owner.rpc(
                f"{operation} (dropped)",
                RPC_RECEIVE_LORA,
                (*bucket.rpc_args(), 0, {}, []),
                self._owner.update_timeout_s,
            )
            raise
        request = LoRARequest(
            lora_name=adapter.name, lora_int_id=self._next_id(), lora_path=in_memory_path(adapter.name)
        )
        retire_ids = [self._requests[name].lora_int_id for name in retire]
        args = (*bucket.rpc_args(), request.lora_int_id, adapter.peft_config, retire_ids)
        try:
            self.last_receive = await self._owner.rpc(
                operation, RPC_RECEIVE_LORA, args, self._owner.update_timeout_s
            )
        finally:  # the workers drop the superseded adapters before they receive
            for name in retire:
                self._forget(name)
        self._requests[adapter.name] = request
        self._in_memory.add(adapter.name)
        if adapter.activate:
            self.default = adapter.name
        logger.info(
            "%s: installed LoRA adapter %r received in memory%s",
            self._owner.name,
            adapter.name,
            f" (unloaded {retire})" if retire else "",
        )

    def close(self) -> None:
        """Forget the adapters (the engine is going away)."""
        self._in_memory.clear()
