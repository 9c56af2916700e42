"""The engine interface shared by local (in-process vLLM) and remote (HTTP) engines.

The trainer, the Tinker service and the benchmarks only ever see `InferenceEngine`; which backend
serves it is a detail of construction. The weight-update types belong to the weight-sync protocol
(`skylift.weight_sync.protocol`) and are re-exported here for the engine interface.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from skylift.utils.engine_errors import (
    EngineCapabilityError,
    EngineError,
    EngineNotFoundError,
    EngineRequestError,
    EngineStartError,
    EngineStateError,
    EngineUnavailableError,
)
from skylift.weight_sync.protocol import WeightBucket, WeightUpdateGroupSpec

__all__ = [
    "TEACHER_FORCING",
    "Completion",
    "EngineCapabilityError",
    "EngineError",
    "EngineStartError",
    "EngineNotFoundError",
    "EngineRequestError",
    "EngineStateError",
    "EngineUnavailableError",
    "GenerateOutput",
    "InferenceEngine",
    "PAUSE_MODES",
    "PauseMode",
    "SamplingParams",
    "StopReason",
    "WeightBucket",
    "WeightUpdateGroupSpec",
    "check_teacher_forcing",
    "teacher_forced_logprobs",
]

StopReason = Literal["stop", "length", "abort"]

#: How a paused engine treats requests in flight: "keep" freezes them (they continue after the
#: resume, with the new weights), "abort" ends them now with the tokens sampled so far.
PauseMode = Literal["keep", "abort"]
PAUSE_MODES: tuple[PauseMode, ...] = ("keep", "abort")


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
    #: added to those tokens' logits before sampling (-100: never sampled, as a vision model's image
    #: tokens); the returned logprobs stay the model's own (vLLM's raw logprobs)
    logit_bias: dict[int, float] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Completion:
    """One sampled continuation of a prompt."""

    token_ids: list[int]
    logprobs: list[float] | None
    stop_reason: StopReason
    text: str | None = None
    matched_stop: int | str | None = None  # the stop string or token id that ended it, if any
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per position, most likely first
    #: per token, the policy version of the weights that sampled it (engines told the version with
    #: `resume_generation(policy_version=...)`); None when the engine was never told one
    token_versions: list[int] | None = None
    #: routing replay (vLLM's ``enable_return_routed_experts``): the experts each token of prompt +
    #: `token_ids` but the last was routed to, an integer array [tokens, layers, top_k]; None: not
    #: captured (`skylift.generator.routed`)
    routed_experts: Any | None = field(default=None, repr=False)


@dataclass
class GenerateOutput:
    """All `n` samples of one prompt."""

    prompt_token_ids: list[int]
    completions: list[Completion] = field(default_factory=list)
    #: log p(token_i | tokens before it) for every prompt token (None for the first), when asked
    prompt_logprobs: list[float | None] | None = None
    #: prompt tokens the engine read from its prefix cache instead of computing (vLLM's
    #: `RequestOutput.num_cached_tokens`; counted once per prompt, not per sample; 0 when unknown)
    prompt_cached_tokens: int = 0


@runtime_checkable
class InferenceEngine(Protocol):
    """What every engine (local or remote) offers. All methods are coroutines."""

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]: ...

    async def sleep(self, level: int = 1) -> None: ...

    async def wake_up(self) -> None: ...

    async def weight_call(self, transport: str, operation: str, payload: dict[str, Any] | None = None) -> Any:
        """One operation of a weight transport's engine half (`skylift.weight_sync.engine_side`)."""
        ...

    async def reset_prefix_cache(self) -> None: ...

    async def health(self) -> bool: ...

    async def tensor_parallel_size(self) -> int: ...

    async def close(self) -> None: ...


#: Sampling parameters of a teacher-forcing pass: one token generated, only the prompt scored.
TEACHER_FORCING = SamplingParams(max_tokens=1, temperature=1.0, logprobs=False, n=1)


def check_teacher_forcing(who: str, sequences: list[list[int]]) -> None:
    """`EngineRequestError` unless every sequence has a token to score (two or more tokens)."""
    short = [i for i, s in enumerate(sequences) if len(s) < 2]
    if short:
        raise EngineRequestError(
            f"{who}: prompt_logprobs needs at least 2 tokens per sequence; sequence {short[0]} is shorter"
        )


def teacher_forced_logprobs(who: str, outputs: list[GenerateOutput]) -> list[list[float]]:
    """log p(token_i | tokens before it) for i >= 1 of each output's prompt (see `TEACHER_FORCING`)."""
    out = []
    for o in outputs:
        values = o.prompt_logprobs
        if values is None or len(values) != len(o.prompt_token_ids) or any(v is None for v in values[1:]):
            raise EngineError(f"{who}: prompt_logprobs: the engine returned no prompt logprobs")
        out.append([float(v) for v in values[1:]])  # type: ignore[arg-type]
    return out


async def score_sequences(
    engine: Any, who: str, sequences: list[list[int]], lora_name: str | None = None
) -> list[list[float]]:
    """`engine.prompt_logprobs` of every engine: one `generate` under `TEACHER_FORCING` that
    scores the prompt tokens; one value per token after the first of each sequence."""
    check_teacher_forcing(who, sequences)
    if lora_name is None:  # engines without LoRA take no `lora_name`
        outputs = await engine.generate(sequences, TEACHER_FORCING, prompt_logprobs=True)
    else:
        outputs = await engine.generate(sequences, TEACHER_FORCING, prompt_logprobs=True, lora_name=lora_name)
    return teacher_forced_logprobs(who, outputs)
