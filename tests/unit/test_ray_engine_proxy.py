"""The Ray engine proxy (`skylift.inference.ray_engine`) without starting Ray: a fake actor handle
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

from skylift.inference.local import LocalVLLMEngine
from skylift.inference.ray_engine import EngineActor, RayEngineClient
from skylift.inference.types import (
    TEACHER_FORCING,
    EngineError,
    EngineRequestError,
    EngineUnavailableError,
    GenerateOutput,
    InferenceEngine,
    SamplingParams,
)


def operations(cls: type) -> list[str]:
    """The public coroutine methods of `cls` (inherited ones too)."""
    return sorted(
        n for n, v in inspect.getmembers(cls) if inspect.iscoroutinefunction(v) and not n.startswith("_")
    )


#: What the actor forwards besides its own start-up; `generate` is tested on its own (the client
#: checks the request and hands the actor a `GenerateCall`).
FORWARDED = [name for name in operations(EngineActor) if name not in ("start", "generate")]


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
    """Name, kind and default of each parameter after `self` (annotations aside). Ray's actor
    decorator adds `_ray_trace_ctx` to an actor class's method signatures in place once an actor of
    it was created in this process (ray/util/tracing/tracing_helper.py): not ours, left out."""
    params = list(inspect.signature(function).parameters.values())[1:]
    return [(p.name, p.kind, p.default) for p in params if p.name != "_ray_trace_ctx"]


def client_over(engine: Any, **kw: Any) -> tuple[RayEngineClient, EngineActor]:
    actor = EngineActor()
    actor.engine = engine
    return RayEngineClient(FakeActorHandle(actor, **kw), name="engine-0", timeout_s=5.0), actor


def test_actor_and_client_offer_the_same_operations_as_the_local_engine() -> None:
    assert operations(RayEngineClient) == sorted([*FORWARDED, "generate", "prompt_logprobs"])
    # what a Ray engine does not offer: start-up (the actor's `start`) and the in-process extras
    extras = ["call", "create", "prompt_top_logprobs", "rpc", "try_reset_prefix_cache"]
    assert operations(LocalVLLMEngine) == sorted([*operations(RayEngineClient), *extras])
    protocol = {
        n for n in vars(InferenceEngine) if not n.startswith("_") and callable(vars(InferenceEngine)[n])
    }
    assert protocol <= set(operations(RayEngineClient))
    assert {"pause_generation", "resume_generation", "weight_call"} <= set(FORWARDED)
    for operation in operations(RayEngineClient):
        local = parameters(getattr(LocalVLLMEngine, operation))
        assert parameters(getattr(RayEngineClient, operation)) == local, operation
        if operation in FORWARDED:
            assert parameters(getattr(EngineActor, operation)) == local, operation
    client = RayEngineClient(actor=None, name="engine-0", timeout_s=5.0)
    assert isinstance(client, InferenceEngine)
    with pytest.raises(AttributeError, match="no attribute 'vllm_engine'"):
        _ = client.vllm_engine  # type: ignore[attr-defined]


@pytest.mark.parametrize("operation", FORWARDED)
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


class GeneratingEngine(RecordingEngine):
    """Answers `generate` with one output per prompt whose prompt tokens are scored -0.5 each."""

    async def generate(self, *args: Any, **kwargs: Any) -> list[GenerateOutput]:
        self.calls.append(("generate", args, kwargs))
        prompts = args[0]
        return [
            GenerateOutput(prompt_token_ids=p, prompt_logprobs=[None] + [-0.5] * (len(p) - 1))
            for p in prompts
        ]


def test_generate_is_checked_by_the_client_and_prompt_logprobs_is_a_teacher_forced_generate() -> None:
    engine = GeneratingEngine()
    client, _ = client_over(engine)
    params = SamplingParams(max_tokens=3, seed=7)
    outputs = asyncio.run(
        client.generate(
            [[1, 2], [3]], params, "s-1", prompt_logprobs=True, images=[None, ["img"]], lora_name="a"
        )
    )
    assert [o.prompt_token_ids for o in outputs] == [[1, 2], [3]]
    args, kwargs = engine.calls[0][1:]
    assert args == ([[1, 2], [3]], params, "s-1")
    assert kwargs == {"prompt_logprobs": True, "images": [None, ["img"]], "lora_name": "a"}
    assert asyncio.run(client.prompt_logprobs([[5, 6, 7]])) == [[-0.5, -0.5]]
    args, kwargs = engine.calls[1][1:]
    assert args == ([[5, 6, 7]], TEACHER_FORCING, None) and kwargs["prompt_logprobs"] is True
    with pytest.raises(EngineRequestError, match="^engine-0: generate: prompt 1 is empty$"):
        asyncio.run(client.generate([[1], []], params))
    with pytest.raises(EngineRequestError, match="^engine-0: generate: 1 image lists for 2 prompts$"):
        asyncio.run(client.generate([[1], [2]], params, images=[None]))
    assert len(engine.calls) == 2  # a refused request never reached the actor


def test_a_call_before_start_or_after_close_says_so_and_close_is_idempotent() -> None:
    client, actor = client_over(None)
    asyncio.run(client.close())  # nothing to close
    with pytest.raises(
        EngineError, match=r"^engine actor: generate called before start\(\) or after close\(\)$"
    ):
        asyncio.run(client.generate([[1]], SamplingParams()))
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
        asyncio.run(client.generate([[1]], SamplingParams()))
    client, _ = client_over(RecordingEngine(), instead=silent)
    client.timeout_s = 0.05
    with pytest.raises(
        EngineUnavailableError, match=r"^engine-0: broadcast.stream gave no answer within 0 s$"
    ):
        asyncio.run(client.weight_call("broadcast", "stream"))
