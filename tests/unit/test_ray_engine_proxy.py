"""The Ray engine proxy (`skylift.cluster.ray_engine`) without starting Ray: a fake actor handle
does what Ray's does for one call (arguments through pickle, the actor method run, an awaitable
back), the engine behind the actor records what reached it.

Forwarding through real Ray actors runs in tests/integration/test_async_training.py
(test_two_engines_serve_rollouts_and_get_new_weights) and test_lora_trainer.py."""

from __future__ import annotations

import asyncio
import inspect
import pickle
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from skylift.cluster.ray_engine import EngineActor, RayEngineClient
from skylift.inference.local import LocalVLLMEngine
from skylift.inference.types import EngineError, EngineUnavailableError, InferenceEngine

#: The engine operations the actor offers (besides its own start-up).
OPERATIONS = sorted(
    name
    for name, value in vars(EngineActor).items()
    if inspect.iscoroutinefunction(value) and not name.startswith("_") and name != "start"
)


class RecordingEngine:
    """Stands in for the actor's `LocalVLLMEngine`: records every call, answers with its name."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[Any, ...], dict[str, Any]]] = []

    def __getattr__(self, operation: str) -> Callable[..., Awaitable[str]]:
        async def call(*args: Any, **kwargs: Any) -> str:
            self.calls.append((operation, args, kwargs))
            return f"{operation} answered"

        return call


class FakeActorHandle:
    """Ray's actor handle for one process: ``handle.<method>.remote(...)`` pickles the arguments,
    runs the actor's method and returns an awaitable of its result (or runs `instead`)."""

    def __init__(self, actor: EngineActor, instead: Callable[[], Awaitable[Any]] | None = None) -> None:
        self._actor = actor
        self._instead = instead

    def __getattr__(self, method: str) -> Any:
        bound = getattr(self._actor, method)  # an AttributeError for a method the actor lacks
        instead = self._instead

        class Method:
            @staticmethod
            def remote(*args: Any, **kwargs: Any) -> Awaitable[Any]:
                if instead is not None:
                    return instead()
                args, kwargs = pickle.loads(pickle.dumps((args, kwargs)))
                return bound(*args, **kwargs)

        return Method()


def parameters(function: Any) -> list[tuple[str, Any, Any]]:
    """Name, kind and default of each parameter after `self` (annotations aside)."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params]


def client_over(engine: Any, **kw: Any) -> tuple[RayEngineClient, EngineActor]:
    actor = EngineActor()
    actor.engine = engine
    return RayEngineClient(FakeActorHandle(actor, **kw), name="engine-0", timeout_s=5.0), actor


def test_actor_and_client_offer_the_same_operations_as_the_local_engine() -> None:
    client_operations = sorted(
        name
        for name, value in vars(RayEngineClient).items()
        if inspect.iscoroutinefunction(value) and not name.startswith("_")
    )
    assert client_operations == OPERATIONS
    protocol = {
        name
        for name in vars(InferenceEngine)
        if not name.startswith("_") and callable(vars(InferenceEngine)[name])
    }
    assert protocol <= set(OPERATIONS)
    assert {"prompt_logprobs", "pause_generation", "resume_generation", "has_weight_update_group"} <= set(
        OPERATIONS
    )
    assert {"load_lora_adapter", "unload_lora_adapter", "receive_lora_adapter"} <= set(OPERATIONS)
    for operation in OPERATIONS:
        local = parameters(getattr(LocalVLLMEngine, operation))
        assert parameters(getattr(EngineActor, operation)) == local, operation
        assert parameters(getattr(RayEngineClient, operation)) == local, operation
    client = RayEngineClient(actor=None, name="engine-0", timeout_s=5.0)
    assert isinstance(client, InferenceEngine)
    with pytest.raises(AttributeError, match="no attribute 'vllm_engine'"):
        _ = client.vllm_engine  # type: ignore[attr-defined]


@pytest.mark.parametrize("operation", OPERATIONS)
def test_each_call_reaches_the_engine_with_its_arguments_and_answers(operation: str) -> None:
    engine = RecordingEngine()
    client, actor = client_over(engine)
    args: list[str] = []
    kwargs: dict[str, str] = {}
    for name, kind, _ in parameters(getattr(LocalVLLMEngine, operation)):
        value = f"{operation}.{name}"
        if kind is inspect.Parameter.KEYWORD_ONLY:
            kwargs[name] = value
        else:
            args.append(value)
    answer = asyncio.run(getattr(client, operation)(*args, **kwargs))
    [(called, got_args, got_kwargs)] = engine.calls
    assert called == operation
    bound = inspect.signature(getattr(LocalVLLMEngine, operation)).bind(None, *got_args, **got_kwargs)
    expected = {name: f"{operation}.{name}" for name, _, _ in parameters(getattr(LocalVLLMEngine, operation))}
    assert {k: v for k, v in bound.arguments.items() if k != "self"} == expected
    returns_nothing = inspect.signature(getattr(RayEngineClient, operation)).return_annotation == "None"
    assert answer == (None if returns_nothing else f"{operation} answered")
    assert (actor.engine is None) == (operation == "close")  # close forgets the engine


def test_a_call_before_start_or_after_close_says_so_and_close_is_idempotent() -> None:
    client, actor = client_over(None)
    asyncio.run(client.close())  # nothing to close
    with pytest.raises(
        EngineError, match=r"^engine actor: generate called before start\(\) or after close\(\)$"
    ):
        asyncio.run(client.generate([[1]], params=None))  # type: ignore[arg-type]
    actor.engine = RecordingEngine()
    asyncio.run(client.close())
    with pytest.raises(EngineError, match="health called before start"):
        asyncio.run(client.health())


def test_a_dead_or_silent_actor_is_an_unavailable_engine() -> None:
    from ray.exceptions import RayActorError

    async def died() -> None:
        raise RayActorError(error_msg="killed")

    async def silent() -> None:
        await asyncio.sleep(60)

    client, _ = client_over(RecordingEngine(), instead=died)
    with pytest.raises(
        EngineUnavailableError, match=r"^engine-0: generate failed: the engine actor died \(killed"
    ):
        asyncio.run(client.generate([[1]], params=None))  # type: ignore[arg-type]
    client, _ = client_over(RecordingEngine(), instead=silent)
    client.timeout_s = 0.05
    with pytest.raises(
        EngineUnavailableError, match=r"^engine-0: receive_weight_stream gave no answer within 0 s$"
    ):
        asyncio.run(client.receive_weight_stream())
