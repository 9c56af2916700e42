"""OpenAI chat-completions wire format: what a request may hold (checked, with a message naming
what is wrong), the messages as the chat template gets them, and the answers (a JSON body or
server-sent events).

An assistant message the agent sends back for a call this session made (matched by its tool call
ids, else by its content) is rendered as the text that was sampled, not as the agent's rewrite of
it (tool calls re-serialised as JSON, content trimmed): the next prompt then starts with the
previous prompt and the sampled ids, so the calls merge into one sequence.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass
from typing import Any

from skylift.envs.tool_parsers import ParsedCalls

TOOL_CHOICES = ("none", "auto", "required")

#: the markup of each parser's calls, taken out of the content the agent is answered with
_CALL_MARKUP = {
    "hermes": re.compile(r"<tool_call>.*?</tool_call>", re.DOTALL),
    "xml": re.compile(r"<tool\s+name\s*=\s*\"[^\"]*\"\s*>.*?</tool>", re.DOTALL),
}


class RequestError(ValueError):
    """The request is not one the gateway serves; the message says what is wrong (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass
class ChatRequest:
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None
    tool_choice: str | dict[str, Any]
    stream: bool
    include_usage: bool
    max_tokens: int | None
    stop: list[str]
    model: str


def parse_chat_request(body: Any) -> ChatRequest:
    """The fields of a ``/v1/chat/completions`` body the gateway uses; `RequestError` otherwise.
    Sampling fields (temperature, top_p, seed, ...) are the run's: the agent's are not used."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise RequestError(f"messages[{i}] must be an object with a role", "messages")
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list) or not all(_is_tool(t) for t in tools):
            raise RequestError(
                'tools must be a list of {"type": "function", "function": {"name": ...}}', "tools"
            )
        tools = tools or None
    choice = body.get("tool_choice", "auto" if tools else "none")
    if isinstance(choice, dict):
        name = (choice.get("function") or {}).get("name") if choice.get("type") == "function" else None
        if not isinstance(name, str):
            raise RequestError(
                'tool_choice must be none, auto, required or {"type": "function", ...}', "tool_choice"
            )
    elif choice not in TOOL_CHOICES:
        raise RequestError(
            f"tool_choice must be one of {', '.join(TOOL_CHOICES)} or a function", "tool_choice"
        )
    if body.get("n", 1) != 1:
        raise RequestError("n must be 1 (one sample per call: each call is one step of the rollout)", "n")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (
        not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1
    ):
        raise RequestError("max_tokens must be a positive integer", "max_tokens")
    stop = body.get("stop") or []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise RequestError("stop must be a string or a list of non-empty strings", "stop")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    options = body.get("stream_options") or {}
    return ChatRequest(
        messages=messages,
        tools=tools,
        tool_choice=choice,
        stream=stream,
        include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
        max_tokens=max_tokens,
        stop=stop,
        model=str(body.get("model") or ""),
    )


def _is_tool(tool: Any) -> bool:
    return (
        isinstance(tool, dict)
        and tool.get("type", "function") == "function"
        and isinstance(tool.get("function"), dict)
        and isinstance(tool["function"].get("name"), str)
    )


def template_messages(messages: list[dict[str, Any]], replay: Any) -> list[dict[str, Any]]:
    """`messages` as the chat template gets them: text content parts joined, an assistant turn of
    this session as its sampled text (`replay(tool_call_ids, content)` -> text or None), other
    tool calls with their arguments as objects (as Hugging Face templates expect)."""
    out = []
    for i, message in enumerate(messages):
        m = dict(message)
        m["content"] = _text(m.get("content"), i)
        if m["role"] == "assistant":
            calls = m.get("tool_calls") or []
            ids = [c.get("id") for c in calls if isinstance(c, dict)]
            sampled = replay([str(x) for x in ids if x], message.get("content"))
            if sampled is not None:
                out.append({"role": "assistant", "content": sampled})
                continue
            if calls:
                m["tool_calls"] = [_call_for_template(c, i) for c in calls]
            else:
                m.pop("tool_calls", None)
        out.append(m)
    return out


def _text(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") not in ("text", "input_text", "output_text"):
                raise RequestError(f"messages[{index}]: only text content parts are served", "messages")
            parts.append(str(part.get("text", "")))
        return "".join(parts)
    raise RequestError(f"messages[{index}].content must be a string or a list of parts", "messages")


def _call_for_template(call: Any, index: int) -> dict[str, Any]:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError(f"messages[{index}].tool_calls: each needs function.name", "messages")
    arguments = function.get("arguments") or {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            raise RequestError(f"messages[{index}].tool_calls: arguments are not JSON", "messages") from None
    return {
        "type": "function",
        "id": call.get("id"),
        "function": {"name": function["name"], "arguments": arguments},
    }


def tool_calls_of(parsed: ParsedCalls) -> list[dict[str, Any]]:
    """OpenAI ``tool_calls`` for the well-formed calls of `parsed` (fresh ids)."""
    return [
        {
            "id": f"call_{secrets.token_hex(12)}",
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(call.arguments)},
        }
        for call in parsed.calls
    ]


def content_without_calls(text: str, parser: str, calls: bool) -> str | None:
    """The answer's content: `text` without the calls' markup when there are calls (None when
    nothing else is left)."""
    if not calls:
        return text
    if parser == "llama3_json":
        return None
    rest = _CALL_MARKUP[parser].sub("", text).strip()
    return rest or None


def finish_reason(engine_reason: str, calls: bool) -> str:
    if calls:
        return "tool_calls"
    return "stop" if engine_reason == "stop" else "length"


@dataclass
class Answer:
    """One call's answer, whichever API carries it: what the agent is told."""

    model: str
    content: str | None  # the sampled text without the calls' markup (None when nothing is left)
    calls: list[dict[str, Any]]  # OpenAI ``tool_calls`` (fresh ``call_...`` ids)
    finish: str  # stop | length | tool_calls
    prompt_tokens: int
    sampled: int


def completion_body(answer: Answer) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.calls:
        message["tool_calls"] = answer.calls
    return {
        "id": f"chatcmpl-{secrets.token_hex(12)}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": answer.model,
        "choices": [{"index": 0, "message": message, "finish_reason": answer.finish, "logprobs": None}],
        "usage": {
            "prompt_tokens": answer.prompt_tokens,
            "completion_tokens": answer.sampled,
            "total_tokens": answer.prompt_tokens + answer.sampled,
        },
    }


def stream_events(body: dict[str, Any], include_usage: bool) -> list[str]:
    """`body` (a finished completion) as ``chat.completion.chunk`` server-sent events: the role,
    the content, the tool calls, the finish reason, the usage when asked, then ``[DONE]``."""
    choice = body["choices"][0]
    message = choice["message"]
    base = {
        "id": body["id"],
        "object": "chat.completion.chunk",
        "created": body["created"],
        "model": body["model"],
    }

    def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
        data = {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]}
        return f"data: {json.dumps(data)}\n\n"

    events = [chunk({"role": "assistant", "content": ""})]
    if message.get("content"):
        events.append(chunk({"content": message["content"]}))
    for k, call in enumerate(message.get("tool_calls") or []):
        events.append(chunk({"tool_calls": [{"index": k, **call}]}))
    events.append(chunk({}, choice["finish_reason"]))
    if include_usage:
        events.append(f"data: {json.dumps({**base, 'choices': [], 'usage': body['usage']})}\n\n")
    events.append("data: [DONE]\n\n")
    return events


def error_body(message: str, kind: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
