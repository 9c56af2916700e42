"""A vLLM engine in a Ray actor and its driver-side client, one typed method per engine operation
(weight sync: one method, `weight_call`, for every transport's operations).

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
)
from skylift.utils.calls import call_with_timeout
from skylift.utils.messages import one_line, plain

if TYPE_CHECKING:
    from skylift.inference.local import LocalVLLMEngine

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

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        """Every weight-sync operation (`weight_sync.engine_side`): one actor method."""
        return await self._live(f"{transport}.{operation}").weight_call(transport, operation, payload)

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
        return await self._remote(method.__name__, method.__name__, *args, **kwargs)

    async def _remote(self, label: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """The actor's `method`, its failures named `label`."""
        result = getattr(self.actor, method).remote(*args, **kwargs)
        return await call_with_timeout(
            self.name,
            label,
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

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        return await self._remote(
            f"{transport}.{operation}", EngineActor.weight_call.__name__, transport, operation, payload
        )

    async def health(self) -> bool:
        return await self._call(EngineActor.health)

    async def tensor_parallel_size(self) -> int:
        return await self._call(EngineActor.tensor_parallel_size)

    async def close(self) -> None:
        await self._call(EngineActor.close)
