"""A vLLM engine in a Ray actor and its driver-side client, one typed method per engine operation.

`EngineActor` holds a `LocalVLLMEngine` and forwards each operation to it; `RayEngineClient` is
the `InferenceEngine` the driver holds: each of its methods calls the actor method it names by
reference (`_call(EngineActor.generate, ...)`, run through Ray's handle of the same name), so a
reader and an IDE can follow every call from the pool to the engine.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

from skylift.inference.engine_base import EngineBase, GenerateCall
from skylift.inference.types import (
    EngineError,
    EngineUnavailableError,
    GenerateOutput,
    PauseMode,
    WeightBucket,
    WeightUpdateGroupSpec,
)
from skylift.utils.calls import call_with_timeout
from skylift.utils.messages import one_line, plain

if TYPE_CHECKING:
    from skylift.inference.local import LocalVLLMEngine
    from skylift.weight_sync.lora.adapter import LoraAdapterSpec
    from skylift.weight_sync.protocol import DeltaSyncRequest

logger = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")


class EngineActor:
    """A `LocalVLLMEngine` living in a Ray actor (made remote by `start_local_engines`)."""

    def __init__(self) -> None:
        self.engine: LocalVLLMEngine | None = None

    async def start(self, model: str, engine_kwargs: dict[str, Any]) -> str:
        from skylift.inference.local import LocalVLLMEngine

        self.engine = await LocalVLLMEngine.create(model, **engine_kwargs)
        return repr(self.engine)

    def node_ip(self) -> str:
        """The IP of the node this engine runs on (what its weight-sync receivers bind)."""
        import ray

        return str(ray.util.get_node_ip_address())

    def _live(self, operation: str) -> LocalVLLMEngine:
        if self.engine is None:
            raise EngineError(f"engine actor: {operation} called before start() or after close()")
        return self.engine

    async def generate(self, call: GenerateCall) -> list[GenerateOutput]:
        """One `generate` request, checked by the client (`EngineBase.generate`)."""
        engine = self._live("generate")
        return await engine.generate(
            call.prompts,
            call.params,
            call.session_id,
            prompt_logprobs=call.prompt_logprobs,
            images=call.images,
            lora_name=call.lora_name,
        )

    async def sleep(self, level: int = 1) -> None:
        await self._live("sleep").sleep(level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return await self._live("wake_up").wake_up(tags)

    async def reset_prefix_cache(self) -> None:
        await self._live("reset_prefix_cache").reset_prefix_cache()

    async def pause_generation(self, mode: PauseMode = "keep") -> None:
        await self._live("pause_generation").pause_generation(mode)

    async def resume_generation(self, policy_version: int | None = None) -> None:
        await self._live("resume_generation").resume_generation(policy_version)

    async def init_weight_update_communicator(self, spec: WeightUpdateGroupSpec) -> None:
        await self._live("init_weight_update_communicator").init_weight_update_communicator(spec)

    async def update_weights(self, bucket: WeightBucket) -> None:
        await self._live("update_weights").update_weights(bucket)

    async def receive_weight_stream(self) -> dict[str, Any]:
        return await self._live("receive_weight_stream").receive_weight_stream()

    async def destroy_weights_update_group(self) -> None:
        await self._live("destroy_weights_update_group").destroy_weights_update_group()

    async def fetch_delta(self, request: DeltaSyncRequest) -> dict[str, Any]:
        return await self._live("fetch_delta").fetch_delta(request)

    async def load_delta(self, request: DeltaSyncRequest) -> dict[str, Any]:
        return await self._live("load_delta").load_delta(request)

    async def has_weight_update_group(self) -> bool:
        return await self._live("has_weight_update_group").has_weight_update_group()

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, load_inplace: bool = False, activate: bool = False
    ) -> None:
        engine = self._live("load_lora_adapter")
        await engine.load_lora_adapter(lora_name, lora_path, load_inplace=load_inplace, activate=activate)

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._live("unload_lora_adapter").unload_lora_adapter(lora_name)

    async def receive_lora_adapter(self, bucket: WeightBucket, adapter: LoraAdapterSpec) -> None:
        await self._live("receive_lora_adapter").receive_lora_adapter(bucket, adapter)

    async def health(self) -> bool:
        return await self._live("health").health()

    async def tensor_parallel_size(self) -> int:
        return await self._live("tensor_parallel_size").tensor_parallel_size()

    async def close(self) -> None:
        """Close the engine and forget it (idempotent; nothing to close before `start`)."""
        if self.engine is not None:
            await self.engine.close()
            self.engine = None


def _actor_died(message: str, exc: Exception) -> Exception | None:
    """A dead actor: `EngineUnavailableError`. An `EngineError` the engine raised in the actor
    (Ray's `RayTaskError`, whose text is the coloured remote traceback): the same error, of its
    type and with its message on one line; the traceback goes to the log."""
    from ray.exceptions import RayActorError, RayTaskError

    if isinstance(exc, RayActorError):
        return EngineUnavailableError(f"{message}: the engine actor died ({one_line(str(exc))})")
    if isinstance(exc, RayTaskError) and isinstance(exc.cause, EngineError):
        logger.info("%s in the engine actor:\n%s", message, plain(str(exc)))
        return type(exc.cause)(one_line(str(exc.cause)))
    return None  # any other error passes as Ray raised it (an instance of its cause's type too)


class RayEngineClient(EngineBase):
    """An `InferenceEngine` whose every call runs the `EngineActor` method of the same name
    (`generate` is checked here first and `prompt_logprobs` is a teacher-forced `generate`: the
    shared front, `EngineBase`).

    Each call has the client's timeout; a dead actor (its process killed or crashed) or one that
    does not answer raises `EngineUnavailableError`, so an `EnginePool` moves the work elsewhere.
    """

    def __init__(self, actor: Any, name: str, timeout_s: float = 600.0) -> None:
        self.actor = actor  # a Ray handle of an `EngineActor`
        self.name = name
        self.timeout_s = timeout_s

    def __repr__(self) -> str:
        return self.name

    async def _call(
        self, method: Callable[Concatenate[EngineActor, P], Awaitable[R]], *args: P.args, **kwargs: P.kwargs
    ) -> R:
        """`method` run on the actor (through Ray's handle of the same name), with the timeout."""
        operation = method.__name__
        result = getattr(self.actor, operation).remote(*args, **kwargs)
        return await call_with_timeout(
            self.name,
            operation,
            result,
            self.timeout_s,
            timeout_error=EngineUnavailableError,
            error=_actor_died,
        )

    async def _generate(self, call: GenerateCall) -> list[GenerateOutput]:
        return await self._call(EngineActor.generate, call)

    async def sleep(self, level: int = 1) -> None:
        await self._call(EngineActor.sleep, level)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        return await self._call(EngineActor.wake_up, tags)

    async def reset_prefix_cache(self) -> None:
        await self._call(EngineActor.reset_prefix_cache)

    async def pause_generation(self, mode: PauseMode = "keep") -> None:
        await self._call(EngineActor.pause_generation, mode)

    async def resume_generation(self, policy_version: int | None = None) -> None:
        await self._call(EngineActor.resume_generation, policy_version)

    async def init_weight_update_communicator(self, spec: WeightUpdateGroupSpec) -> None:
        await self._call(EngineActor.init_weight_update_communicator, spec)

    async def update_weights(self, bucket: WeightBucket) -> None:
        await self._call(EngineActor.update_weights, bucket)

    async def receive_weight_stream(self) -> dict[str, Any]:
        return await self._call(EngineActor.receive_weight_stream)

    async def destroy_weights_update_group(self) -> None:
        await self._call(EngineActor.destroy_weights_update_group)

    async def fetch_delta(self, request: DeltaSyncRequest) -> dict[str, Any]:
        return await self._call(EngineActor.fetch_delta, request)

    async def load_delta(self, request: DeltaSyncRequest) -> dict[str, Any]:
        return await self._call(EngineActor.load_delta, request)

    async def has_weight_update_group(self) -> bool:
        return await self._call(EngineActor.has_weight_update_group)

    async def load_lora_adapter(
        self, lora_name: str, lora_path: str, *, load_inplace: bool = False, activate: bool = False
    ) -> None:
        await self._call(
            EngineActor.load_lora_adapter, lora_name, lora_path, load_inplace=load_inplace, activate=activate
        )

    async def unload_lora_adapter(self, lora_name: str) -> None:
        await self._call(EngineActor.unload_lora_adapter, lora_name)

    async def receive_lora_adapter(self, bucket: WeightBucket, adapter: LoraAdapterSpec) -> None:
        await self._call(EngineActor.receive_lora_adapter, bucket, adapter)

    async def health(self) -> bool:
        return await self._call(EngineActor.health)

    async def tensor_parallel_size(self) -> int:
        return await self._call(EngineActor.tensor_parallel_size)

    async def close(self) -> None:
        await self._call(EngineActor.close)
