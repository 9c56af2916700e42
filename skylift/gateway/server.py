"""The gateway: an OpenAI-compatible server on the run's event loop that samples the run's engines.

`Gateway.start` serves `skylift.gateway.app` on ``host`` at a free port; `Gateway.open` gives a
`Session` its base URL, ``http://HOST:PORT/s/<session id>/v1`` (the id is 32 random characters: a
URL is the only way in). `Gateway.complete` serves one chat call: the messages rendered with the
policy tokenizer's chat template (tools included), one sample on the engines token-in/token-out
with the session's sampling, the call recorded (`CallRecord`), tool calls parsed with skylift's
parsers (`skylift.envs.tool_parsers`) and answered in OpenAI's format.

A call that goes on from an earlier call of its session (that call's conversation, its reply as
sampled, then more messages: the agent's next step) is sent to the engine token-in/token-out as
skylift's own loop does: the earlier call's prompt ids and sampled ids as they were, then what the
template renders after them (`skylift.generator.chat.ChatFormat.extension`: the turn's close, the
new messages, the next assistant header), never the sampled text re-tokenised (a sampler may
choose another tokenisation of its text than the tokenizer's). Where the template renders the
earlier turns differently once more follow (it rewrites history), the call's prompt is the
rendering (a new sample of the rollout).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

from skylift.envs.tool_parsers import ParsedCalls, get_tool_parser
from skylift.gateway.openai_format import (
    Answer,
    ChatRequest,
    completion_body,
    content_without_calls,
    finish_reason,
    template_messages,
    tool_calls_of,
)
from skylift.gateway.responses_format import (
    ResponsesRequest,
    answer_message,
    new_response_id,
    response_body,
)
from skylift.gateway.session import BudgetExceeded, CallRecord, Session
from skylift.generator.chat import ChatFormat, TemplateMismatch
from skylift.generator.routed import routed_tokens
from skylift.generator.settings import TURN_SEED_STRIDE
from skylift.inference.types import InferenceEngine

#: seed offset between the calls of one rollout (as between the turns of skylift's own loop)
CALL_SEED_STRIDE = TURN_SEED_STRIDE
START_TIMEOUT_S = 30.0


@dataclass
class GatewayLimits:
    max_input_length: int  # most prompt tokens of one call
    max_generate_length: int  # most sampled tokens of one call
    engine_versions: bool = False  # label calls with the engines' per-token versions
    routed_experts: bool = False  # routing replay: every call must come with its routed experts


class Gateway:
    """Serves `Session` s on `engine`; one per run."""

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer: Any,
        limits: GatewayLimits,
        *,
        tool_parser: str = "hermes",
        model_name: str = "policy",
        host: str = "127.0.0.1",
        template_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.limits = limits
        self.parser_name = tool_parser
        self.parse = get_tool_parser(tool_parser)
        self.model_name = model_name
        self.host = host
        self.template_kwargs = dict(template_kwargs or {})
        self.chat = ChatFormat(tokenizer, self.template_kwargs)
        self.sessions: dict[str, Session] = {}
        self.port: int | None = None
        self._server: Any = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        """Serve on a free port of `host` (on the running loop); idempotent."""
        if self._task is not None and not self._task.done():
            return
        import uvicorn

        from skylift.gateway.app import gateway_app

        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, 0))
        self.port = int(sock.getsockname()[1])
        config = uvicorn.Config(
            gateway_app(self), log_level="warning", access_log=False, lifespan="off", timeout_keep_alive=30
        )
        self._server = _QuietServer(config)
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[sock]))
        waited = 0.0
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it stopped
                raise RuntimeError("the gateway's server stopped while starting")
            if waited > START_TIMEOUT_S:
                raise RuntimeError(f"the gateway did not start within {START_TIMEOUT_S:g} s")
            await asyncio.sleep(0.01)
            waited += 0.01

    async def aclose(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._task, 10.0)
        self._server = self._task = None
        self.sessions.clear()

    # ------------------------------------------------------------------ sessions
    def open(self, session: Session) -> str:
        """Register `session`; its base URL (``.../s/<id>/v1``)."""
        if self.port is None:
            raise RuntimeError("Gateway.start() first")
        self.sessions[session.id] = session
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/s/{session.id}/v1"

    def close(self, session: Session) -> None:
        """Refuse further calls of `session` (404) and forget it."""
        session.closed = True
        self.sessions.pop(session.id, None)

    # ------------------------------------------------------------------ calls
    def render(self, messages: list[dict[str, Any]], tools: Any = None) -> list[int]:
        """`messages` rendered by the chat template, with the next assistant header."""
        return self.chat.prompt_ids(messages, tools)

    def prompt_ids(self, session: Session, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        """The ids of a call of `session`: where it goes on from an earlier call, that call's prompt
        and sampled ids, then the rest of the rendering; else the rendering."""
        rendered = self.render(messages, tools)
        earlier = session.continued_call(messages, tools)
        if earlier is None:
            return rendered
        done = earlier.prompt_ids + earlier.sampled_ids
        try:
            return done + self.chat.extension(done, rendered)
        except TemplateMismatch:
            return rendered

    async def complete(self, session: Session, request: ChatRequest) -> dict[str, Any]:
        """One chat call of `session`: its ``chat.completion`` body (`answer`)."""
        return completion_body(await self.answer(session, request))

    async def respond(self, session: Session, request: ResponsesRequest) -> dict[str, Any]:
        """One Responses call of `session`: its ``response`` object, kept for a later request's
        ``previous_response_id``."""
        answer = await self.answer(session, request.chat)
        response_id = new_response_id()
        session.responses[response_id] = [*request.conversation, answer_message(answer)]
        return response_body(request, answer, response_id)

    async def answer(self, session: Session, request: ChatRequest) -> Answer:
        """One call of `session`: sample, record, answer. Raises `BudgetExceeded` (ending the
        session) when its budget or the context length allows none."""
        left = session.admit()
        messages = template_messages(request.messages, session.replayed_text)
        prompt_ids = self.prompt_ids(session, messages, request.tools)
        if len(prompt_ids) > self.limits.max_input_length:
            session.stop_reason = (
                f"context exceeded: the prompt has {len(prompt_ids)} tokens, more than "
                f"{self.limits.max_input_length} (the run's max input length)"
            )
            raise BudgetExceeded(session.stop_reason)
        p = session.params
        max_tokens = min(p.max_tokens, self.limits.max_generate_length, left, request.max_tokens or left)
        seed = None if session.seed is None else session.seed + len(session.calls) * CALL_SEED_STRIDE
        params = replace(
            p,
            n=1,
            max_tokens=max_tokens,
            seed=seed,
            logprobs=True,
            stop=(list(p.stop or []) + request.stop) or None,
        )
        out = await self.engine.generate([prompt_ids], params, session.id)
        completion = out[0].completions[0]
        sampled = [int(t) for t in completion.token_ids]
        text = str(self.tokenizer.decode(sampled, skip_special_tokens=True))
        parsed = self.parse(text) if request.tools and request.tool_choice != "none" else ParsedCalls()
        calls = tool_calls_of(parsed)
        content = content_without_calls(text, self.parser_name, bool(calls))
        versions = completion.token_versions if self.limits.engine_versions else None
        session.calls.append(
            CallRecord(
                prompt_ids=prompt_ids,
                sampled_ids=sampled,
                logprobs=list(completion.logprobs or [0.0] * len(sampled)),
                finish_reason=completion.stop_reason,
                policy_version=min(versions) if versions else session.policy_version,
                token_versions=list(versions) if versions else None,
                text=text,
                tool_call_ids=[c["id"] for c in calls],
                content=content,
                routed_experts=routed_tokens(
                    completion, len(prompt_ids) + len(sampled), self.limits.routed_experts
                ),
                messages=messages,
                tools=request.tools,
            )
        )
        session.tool_calls += len(calls)
        finish = finish_reason(completion.stop_reason, bool(calls))
        return Answer(request.model or self.model_name, content, calls, finish, len(prompt_ids), len(sampled))


class _QuietServer:
    """uvicorn's server without its signal handlers (Ctrl-C stays the trainer's)."""

    def __new__(cls, config: Any) -> Any:
        import uvicorn

        class Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Iterator[None]:
                yield

        return Server(config)
