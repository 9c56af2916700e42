"""A gateway session: one rollout of an agent, its budget and the model calls it made.

Each call is recorded as it was sampled (`CallRecord`: the prompt ids the chat template rendered,
the sampled ids and their logprobs, why it stopped, the policy version); the rollout's
trajectories are built from these records only (`skylift.gateway.trajectories`), never from the
text the agent sends back. A `Budget` bounds a session's calls, sampled tokens and wall time; the
first call over it ends the session (`Session.stop_reason`) and every later call is refused.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from skylift.inference.types import SamplingParams


class BudgetExceeded(Exception):
    """A call the session's budget does not allow; the message names the budget."""


@dataclass(frozen=True)
class Budget:
    """Most model calls, sampled tokens and seconds (from the session's start) of one rollout."""

    max_calls: int = 32
    max_tokens: int = 16384
    max_seconds: float = 600.0


@dataclass
class CallRecord:
    """One model call as the engine served it."""

    prompt_ids: list[int]
    sampled_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # the engine's stop reason: stop | length | abort
    policy_version: int
    token_versions: list[int] | None
    text: str  # the sampled ids decoded (special tokens skipped), what a replayed turn renders as
    tool_call_ids: list[str] = field(default_factory=list)  # the ids of the calls parsed from it
    content: str | None = None  # the content the agent was answered with (tool calls taken out)
    #: routing replay: the engine's routed experts of prompt + sampled ids (`Completion.routed_experts`)
    routed_experts: Any = field(default=None, repr=False)
    #: the conversation as the chat template got it, and the tools: a later call that goes on from
    #: it (this call's reply as sampled, then more messages) starts with this call's ids
    messages: list[dict[str, Any]] | None = field(default=None, repr=False)
    tools: Any = field(default=None, repr=False)


@dataclass
class Session:
    """One rollout's view of the gateway."""

    params: SamplingParams  # the run's sampling for this rollout (train or evaluation)
    policy_version: int
    budget: Budget
    seed: int | None = None  # call k samples with seed + k * seed_stride
    id: str = field(default_factory=lambda: secrets.token_urlsafe(24))
    clock: Callable[[], float] = time.monotonic
    started: float = -1.0
    calls: list[CallRecord] = field(default_factory=list)
    stop_reason: str | None = None  # why the session was ended (a budget), None while open
    closed: bool = False
    tool_calls: int = 0  # tool calls answered to the agent
    meta: dict[str, Any] = field(default_factory=dict)
    #: the conversations of this session's Responses answers (input and output as chat messages),
    #: by response id, for a later request's ``previous_response_id`` (at most one per call)
    responses: dict[str, list[dict[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.started < 0:
            self.started = self.clock()

    @property
    def tokens(self) -> int:
        return sum(len(call.sampled_ids) for call in self.calls)

    def admit(self) -> int:
        """The most tokens the next call may sample; raises `BudgetExceeded` (and ends the
        session) when the budget allows no call."""
        if self.stop_reason is not None:
            raise BudgetExceeded(f"this rollout was ended: {self.stop_reason}")
        b = self.budget
        problem = None
        if len(self.calls) >= b.max_calls:
            problem = f"budget exceeded: max_calls={b.max_calls} model calls per rollout"
        elif self.tokens >= b.max_tokens:
            problem = f"budget exceeded: max_tokens={b.max_tokens} sampled tokens per rollout"
        elif self.clock() - self.started >= b.max_seconds:
            problem = f"budget exceeded: max_session_s={b.max_seconds:g} seconds per rollout"
        if problem is not None:
            self.stop_reason = problem
            raise BudgetExceeded(problem)
        return b.max_tokens - self.tokens

    def replayed_text(self, tool_call_ids: list[str], content: Any) -> str | None:
        """The sampled text of the call an assistant message of the agent answers for (matched by
        its tool call ids, else by its content), or None when no recorded call matches."""
        for call in reversed(self.calls):
            if tool_call_ids and call.tool_call_ids == tool_call_ids:
                return call.text
            if (
                not tool_call_ids
                and not call.tool_call_ids
                and content is not None
                and call.content == content
            ):
                return call.text
        return None

    def continued_call(self, messages: list[dict[str, Any]], tools: Any) -> CallRecord | None:
        """The latest call whose conversation `messages` go on from: that call's messages, then
        its reply as sampled (an assistant message of its text), then more; the same tools."""
        for call in reversed(self.calls):
            n = len(call.messages) if call.messages is not None else -1
            if (
                0 <= n < len(messages) - 1
                and call.tools == tools
                and messages[n] == {"role": "assistant", "content": call.text}
                and messages[:n] == call.messages
            ):
                return call
        return None
