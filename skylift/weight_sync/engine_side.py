"""The engine-side face of weight sync: one receiver object per transport, one generic call.

Every engine client (`LocalVLLMEngine`, `RemoteInferenceEngine`, the Ray engine client,
`EnginePool`) carries weight sync through ONE method, ``weight_call(transport, operation,
payload)``: `transport` names a transport's engine half (`EngineSide`, one per transport folder:
`broadcast.engine`, `lora.engine`, `delta.engine`, `ipc.engine`; which exist is said once, in
`weight_sync.factory.ENGINE_SIDES`), `operation` one of its operations, and `payload` is a
JSON-ready dict (it crosses HTTP and Ray unchanged); the answer is JSON-ready too. Only the
engine that holds vLLM (`LocalVLLMEngine`) runs the operation: it hands the call to its
`EngineSides`; the other clients only carry it (HTTP: ``POST /skylift/weights/{transport}/
{operation}``; Ray: one actor method). A new transport therefore needs no engine, route or
client edit: its folder and the factory.

An `EngineSide` works through `EngineHost`, what it needs of the engine it lives in (its vLLM
workers' ``collective_rpc``, the weight lock, the timeouts, the prefix-cache reset), and shares
`WeightState` (the weight-update group the workers are in, the count of weight loads) with the
other transports' sides of the same engine.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from skylift.utils.engine_errors import EngineNotFoundError, EngineRequestError

Payload = dict[str, Any]
Operation = Callable[[Payload], Awaitable[Any]]


class WeightCall(Protocol):
    """What every engine client offers weight sync: the one generic path."""

    async def weight_call(self, transport: str, operation: str, payload: Payload | None = None) -> Any: ...


class EngineHost(Protocol):
    """What an engine side uses of the engine it lives in (`LocalVLLMEngine`)."""

    name: str
    model_path: str | None
    update_timeout_s: float
    control_timeout_s: float
    #: vLLM's `OpenAIServingModels` when the engine serves HTTP (its LoRA table), else None
    lora_registry: Any

    @property
    def vllm_engine(self) -> Any: ...
    @property
    def workers(self) -> int:
        """How many vLLM workers (tensor-parallel ranks) the engine has."""
        ...

    async def rpc(self, operation: str, method: str, args: tuple, timeout_s: float) -> list[Any]:
        """`method(*args)` on every vLLM worker (``collective_rpc``); one result per worker."""
        ...

    async def call(self, operation: str, awaitable: Awaitable[Any], timeout_s: float) -> Any:
        """Await one engine call with a timeout; failures become `EngineError`s naming the engine."""
        ...

    async def try_reset_prefix_cache(self) -> bool: ...


@dataclass
class WeightState:
    """The weight state the transports of one engine share.

    `group_name`: the weight-update group its workers are in (None: none), as the calls left it;
    `version`: how many times weights were loaded over a group (buckets or streams), which tells
    the delta side whether the engine still holds what its store knows; `lock`: held by every
    call that changes weights, so two never interleave."""

    group_name: str | None = None
    version: int = 0

    def __post_init__(self) -> None:
        self.lock = asyncio.Lock()


class EngineSide:
    """A transport's engine half: its operations by name, each taking and returning JSON-ready
    values. Subclasses set `transport` and fill `operations` in their constructor."""

    transport: ClassVar[str]
    #: payload fields that name paths on the engine's host: a server checks them against the
    #: roots it allows (``--delta-sync-root``) before the call reaches the engine
    checked_paths: ClassVar[tuple[str, ...]] = ()

    def __init__(self, host: EngineHost, state: WeightState) -> None:
        self.host, self.state = host, state
        self.operations: dict[str, Operation] = {}

    async def call(self, operation: str, payload: Payload) -> Any:
        handler = self.operations.get(operation)
        if handler is None:
            raise EngineNotFoundError(
                f"{self.host.name}: weight transport {self.transport!r} has no operation {operation!r} "
                f"(it has: {', '.join(sorted(self.operations))})"
            )
        return await handler(payload)

    def close(self) -> None:
        """The engine is going away (nothing to do by default)."""


def decode(host: EngineHost, operation: str, cls: Callable[..., Any], payload: Mapping[str, Any]) -> Any:
    """`cls(**payload)`; a payload that does not fit is an `EngineRequestError` naming the operation."""
    try:
        return cls(**payload)
    except TypeError as exc:
        raise EngineRequestError(f"{host.name}: {operation}: bad payload: {exc}") from exc


class EngineSides:
    """The engine halves of every transport for one engine, and the one dispatch to them."""

    def __init__(self, host: EngineHost, kinds: Mapping[str, type[EngineSide]]) -> None:
        self.host = host
        self.state = WeightState()
        self.sides = {name: kind(host, self.state) for name, kind in kinds.items()}

    def __getitem__(self, transport: str) -> EngineSide:
        return self.sides[transport]

    async def call(self, transport: str, operation: str, payload: Payload | None = None) -> Any:
        side = self.sides.get(transport)
        if side is None:
            raise EngineNotFoundError(
                f"{self.host.name}: no weight transport {transport!r} (there are: {', '.join(sorted(self.sides))})"
            )
        if payload is not None and not isinstance(payload, dict):
            raise EngineRequestError(
                f"{self.host.name}: {transport}.{operation}: the payload must be an object"
            )
        return await side.call(operation, payload or {})

    def close(self) -> None:
        for side in self.sides.values():
            side.close()
