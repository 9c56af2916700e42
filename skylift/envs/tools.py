"""Tool-calling environments: tools declared by the environment, calls parsed and run, results back.

A `ToolEnvironment` subclass lists its tools (Python functions with Google-style docstrings, whose
JSON schema is read the way ``transformers`` does for ``apply_chat_template(tools=...)``, or `Tool`
objects built from a JSON schema) and implements `ToolEnvironment.answer` for a response that
calls no tool. The generator passes `tool_schemas()` to the chat template as ``tools=``. Each step:

1. the response is parsed with the environment's ``tool_parser`` (`skylift.envs.tool_parsers`);
2. no call: ``answer(response)`` scores it (usually the end of the trajectory);
3. calls: each runs through the `ToolRunner` (a timeout per call, a limit on calls running at once;
   plain functions run in threads, ``async def`` tools on the event loop); every result, and every
   malformed, unknown, failing or timed-out call, comes back as a ``tool`` message, so a bad call is
   an error the model reads, never a crash.

Per step metrics (summed per trajectory, logged as ``env/<name>``): ``tool_calls``,
``tool_parse_failures``, ``tool_errors`` and ``tool_time_s``.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from skylift.envs.base import Environment, Message, StepResult
from skylift.envs.tool_parsers import ToolCall, get_tool_parser


@dataclass(frozen=True)
class Tool:
    """A tool: its JSON schema (OpenAI function format) and the function that runs it."""

    schema: dict[str, Any]
    fn: Callable[..., Any]

    @property
    def name(self) -> str:
        return str(self.schema["function"]["name"])

    @classmethod
    def from_function(cls, fn: Callable[..., Any]) -> Tool:
        """The schema of `fn` from its signature and docstring (``Args:`` section, type hints)."""
        from transformers.utils import get_json_schema

        return cls(schema=get_json_schema(fn), fn=fn)

    @classmethod
    def from_schema(cls, schema: dict[str, Any], fn: Callable[..., Any]) -> Tool:
        """A tool from a JSON schema, ``{"type": "function", "function": {...}}`` or the bare
        ``{"name", "description", "parameters"}``, run by `fn`."""
        function = schema.get("function", schema)
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise ValueError(f"a tool schema needs function.name, got {schema!r}")
        function = {"parameters": {"type": "object", "properties": {}}, **function}
        return cls(schema={"type": "function", "function": function}, fn=fn)

    def check_arguments(self, arguments: dict[str, Any]) -> str | None:
        """Why `arguments` do not fit the schema (a missing required or an unknown name), or None."""
        params = self.schema["function"].get("parameters") or {}
        known = set(params.get("properties") or {})
        missing = [k for k in params.get("required") or [] if k not in arguments]
        unknown = sorted(set(arguments) - known)
        if missing:
            return f"{self.name}: missing required argument(s) {missing}"
        if unknown:
            return f"{self.name}: unknown argument(s) {unknown}; it takes {sorted(known)}"
        return None


def as_tool(spec: Tool | Callable[..., Any]) -> Tool:
    """`spec` as a `Tool` (a function becomes one through its docstring)."""
    if isinstance(spec, Tool):
        return spec
    if callable(spec):
        return Tool.from_function(spec)
    raise TypeError(f"a tool must be a Tool or a function, got {type(spec).__name__}")


@dataclass(frozen=True)
class ToolOutcome:
    """What one call returned (its text for the model), whether it failed, and how long it ran."""

    content: str
    error: bool
    seconds: float


class ToolRunner:
    """Runs tool calls with a timeout each and at most `max_concurrency` at once (per event loop)."""

    def __init__(self, timeout_s: float = 10.0, max_concurrency: int = 8) -> None:
        if timeout_s <= 0 or max_concurrency < 1:
            raise ValueError(
                f"need timeout_s > 0 and max_concurrency >= 1, got {timeout_s}, {max_concurrency}"
            )
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self._limits: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        for old in [other for other in self._limits if other.is_closed()]:
            del self._limits[old]
        if loop not in self._limits:
            self._limits[loop] = asyncio.Semaphore(self.max_concurrency)
        return self._limits[loop]

    async def run(self, tool: Tool, arguments: dict[str, Any]) -> ToolOutcome:
        bad = tool.check_arguments(arguments)
        if bad is not None:
            return ToolOutcome(f"error: {bad}", True, 0.0)
        async with self._limit():
            tick = time.perf_counter()
            try:
                if inspect.iscoroutinefunction(tool.fn):
                    work: Awaitable[Any] = tool.fn(**arguments)
                else:  # a thread that outlives its timeout finishes unobserved
                    work = asyncio.to_thread(tool.fn, **arguments)
                result = await asyncio.wait_for(work, self.timeout_s)
            except TimeoutError:
                return ToolOutcome(
                    f"error: {tool.name} timed out after {self.timeout_s:g} s",
                    True,
                    time.perf_counter() - tick,
                )
            except Exception as exc:  # the tool's failure is the model's observation
                return ToolOutcome(
                    f"error: {tool.name} failed: {type(exc).__name__}: {exc}",
                    True,
                    time.perf_counter() - tick,
                )
            return ToolOutcome(_as_text(result), False, time.perf_counter() - tick)


def _as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


class ToolEnvironment(Environment):
    """A multi-turn environment whose policy may call `tools` before it answers.

    Config: ``tool_parser`` (``hermes`` | ``llama3_json`` | ``xml``), ``max_calls_per_turn`` (more
    calls in one response are answered with an error) and ``tool_role`` (the role of result
    messages: ``tool``; Llama 3.1's template calls it ``ipython``).
    """

    #: the tools every instance offers: functions with docstrings, or `Tool` objects
    tools: ClassVar[Sequence[Tool | Callable[..., Any]]] = ()

    def __init__(
        self, tool_parser: str = "hermes", max_calls_per_turn: int = 4, tool_role: str = "tool", **config: Any
    ) -> None:
        if max_calls_per_turn < 1:
            raise ValueError(f"max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        super().__init__(
            tool_parser=tool_parser, max_calls_per_turn=max_calls_per_turn, tool_role=tool_role, **config
        )
        self.parse = get_tool_parser(tool_parser)
        self.max_calls_per_turn = max_calls_per_turn
        self.tool_role = tool_role
        self._tools = {tool.name: tool for tool in map(as_tool, self.tools)}

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return [tool.schema for tool in self._tools.values()] or None

    @abstractmethod
    def answer(self, action: str) -> StepResult | Awaitable[StepResult]:
        """Score a response that calls no tool (may be ``async def``); usually ``done=True``."""

    async def step(self, action: str) -> StepResult:
        self._begin_step()
        parsed = self.parse(action)
        if not parsed.found:
            result = self.answer(action)
            if inspect.isawaitable(result):
                result = await result
            if result.done:
                self.done = True
            return result
        if self.tool_runner is None:
            self.tool_runner = ToolRunner()
        calls, extra = parsed.calls[: self.max_calls_per_turn], parsed.calls[self.max_calls_per_turn :]
        outcomes = await asyncio.gather(*(self._run(call) for call in calls))
        observations: list[Message] = [
            {"role": self.tool_role, "name": call.name, "content": outcome.content}
            for call, outcome in zip(calls, outcomes, strict=True)
        ]
        errors = [f"error: {message}" for message in parsed.errors]
        if extra:
            errors.append(
                f"error: at most {self.max_calls_per_turn} tool calls per turn; {len(extra)} not run"
            )
        observations += [{"role": self.tool_role, "content": message} for message in errors]
        metrics = {
            "tool_calls": float(len(calls)),
            "tool_parse_failures": float(len(parsed.errors)),
            "tool_errors": float(sum(outcome.error for outcome in outcomes)),
            "tool_time_s": sum(outcome.seconds for outcome in outcomes),
        }
        return StepResult(observations=observations, reward=0.0, done=False, metrics=metrics)

    async def _run(self, call: ToolCall) -> ToolOutcome:
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolOutcome(
                f"error: unknown tool {call.name!r}; available: {sorted(self._tools)}", True, 0.0
            )
        return await self.tool_runner.run(tool, call.arguments)
