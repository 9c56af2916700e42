"""Token-level environments: token ids in, token ids out, no chat template in between.

A `TokenEnvironment` gives the generator the prompt as token ids (`init_tokens`), receives the ids
the policy sampled (`step_tokens`) and answers with the whole context of the next turn as ids
(tinker-cookbook's ``Env`` protocol, which `skylift.integrations.tinker_cookbook.env` adapts). The generator
(`skylift.generator.token_turns`) keeps the sampled ids as they are and adds the ids the
environment put after them as untrained tokens; a next context that does not start with the
previous context and the sampled ids (the environment rewrote history) is refused with a clear
error.

A stop condition is a list of stop strings or a list of stop token ids (added to the run's own).
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Any

from skylift.envs.base import Environment, EnvUsageError, Message, StepResult

StopCondition = list[str] | list[int] | None


@dataclass
class TokenPrompt:
    """The first turn's context as token ids, and when sampling stops."""

    ids: list[int]
    stop: StopCondition = None


@dataclass
class TokenStep:
    """The outcome of one `TokenEnvironment.step_tokens`.

    next_ids: the next turn's whole context (unused when done); stop: its stop condition.
    """

    reward: float
    done: bool
    next_ids: list[int] = field(default_factory=list)
    stop: StopCondition = None
    metadata: dict[str, Any] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)


class TokenEnvironment(Environment):
    """Base class of token-level environments; the generator calls `init_tokens`/`step_tokens`
    (either may be ``async def``) instead of `init`/`step`."""

    @abstractmethod
    def init_tokens(
        self, prompt: list[Message], extras: dict[str, Any]
    ) -> TokenPrompt | Awaitable[TokenPrompt]:
        """Start a trajectory for the dataset row's `prompt` and `extras`; return the context."""

    @abstractmethod
    def step_tokens(
        self, action: list[int], stop_reason: str, logprobs: list[float] | None
    ) -> TokenStep | Awaitable[TokenStep]:
        """Consume the sampled ids `action` (the engine's `stop_reason`: ``stop``, ``length``...)."""

    def step(self, action: str) -> StepResult:
        raise EnvUsageError(
            f"{type(self).__name__} is token-level: the generator calls step_tokens, not step"
        )


def stop_fields(stop: StopCondition) -> dict[str, Any]:
    """`stop` as `SamplingParams` fields: ``stop`` (strings) or ``stop_token_ids`` (ints)."""
    if not stop:
        return {}
    if all(isinstance(s, str) for s in stop):
        return {"stop": [str(s) for s in stop]}
    if all(isinstance(s, int) and not isinstance(s, bool) for s in stop):
        return {"stop_token_ids": [int(s) for s in stop]}
    raise ValueError(f"a stop condition is a list of strings or a list of token ids, got {stop!r}")
