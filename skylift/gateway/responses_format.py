"""OpenAI Responses wire format (``POST /v1/responses``) over the gateway's chat calls.

A Responses request is turned into a chat request (`parse_responses_request`, which ends with the
chat checks of `skylift.gateway.openai_format.parse_chat_request`): ``instructions`` becomes the system message,
``input`` (a string, or items) the conversation: message items as messages, ``function_call``
items as the assistant's ``tool_calls`` (with their ``call_id``), ``function_call_output`` items
as ``tool`` messages; ``reasoning`` items are skipped. ``previous_response_id`` names an earlier
response of the same session, whose conversation (its input and its output) comes first. Function
tools are served; other tool types (web search, file search, MCP, ...) are refused naming the type.

The answer is a ``response`` object: a ``message`` item with the content (tool calls' markup taken
out) and one ``function_call`` item per call, whose ``call_id`` is the id the chat answer gives
(so a function call sent back as input is rendered as the text that was sampled, and the calls of
a rollout merge into one sequence, as with chat completions). With ``"stream": true`` it comes as
the Responses server-sent events once it is sampled (created, in progress, each item added, its
text or arguments, done, then ``response.completed``, or ``response.incomplete`` when the call ran
out of tokens).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from skylift.gateway.openai_format import Answer, ChatRequest, RequestError, parse_chat_request

#: Responses input item types that are not part of a chat conversation and are skipped
SKIPPED_ITEMS = ("reasoning",)


@dataclass
class ResponsesRequest:
    chat: ChatRequest  # the request as a chat call
    #: chat messages: the earlier response's conversation, then this input (not the instructions,
    #: which OpenAI does not carry over to a later response either)
    conversation: list[dict[str, Any]]
    stream: bool
    tools: list[dict[str, Any]]  # as the agent sent them (echoed in the response)
    tool_choice: Any
    instructions: str | None
    previous_response_id: str | None


def parse_responses_request(body: Any, earlier: dict[str, list[dict[str, Any]]]) -> ResponsesRequest:
    """The request as a chat conversation; `earlier` maps this session's response ids to their
    conversations (for ``previous_response_id``). `RequestError` names what is not served."""
    if not isinstance(body, dict):
        raise RequestError("the body must be a JSON object")
    previous = body.get("previous_response_id")
    conversation: list[dict[str, Any]] = []
    if previous is not None:
        if not isinstance(previous, str) or previous not in earlier:
            raise RequestError(
                "previous_response_id must name a response of this session", "previous_response_id"
            )
        conversation = list(earlier[previous])
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise RequestError("instructions must be a string", "instructions")
    system = [{"role": "system", "content": instructions}] if instructions else []
    conversation += input_messages(body.get("input"))
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    choice = body.get("tool_choice", "auto")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise RequestError("stream must be true or false", "stream")
    chat_body: dict[str, Any] = {
        "messages": system + conversation,
        "tools": [chat_tool(t, i) for i, t in enumerate(tools)] or None,
        "tool_choice": chat_tool_choice(choice) if tools else "none",
        "model": body.get("model") or "",
    }
    limit = body.get("max_output_tokens")
    if limit is not None:
        if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
            raise RequestError("max_output_tokens must be a positive integer", "max_output_tokens")
        chat_body["max_tokens"] = limit
    return ResponsesRequest(
        chat=parse_chat_request(chat_body),
        conversation=conversation,
        stream=stream,
        tools=tools,
        tool_choice=choice,
        instructions=instructions,
        previous_response_id=previous,
    )


def input_messages(items: Any) -> list[dict[str, Any]]:
    """``input`` (a string or a list of items) as chat messages."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise RequestError("input must be a string or a non-empty list of items", "input")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise RequestError(f"input[{i}] must be an object", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"input[{i}].role must be user, system, developer or assistant", "input")
            messages.append(
                {"role": "system" if role == "developer" else role, "content": item.get("content")}
            )
        elif kind == "function_call":
            call_id, name = item.get("call_id"), item.get("name")
            if not isinstance(call_id, str) or not isinstance(name, str):
                raise RequestError(f"input[{i}]: a function_call needs call_id and name", "input")
            call = {
                "id": call_id,
                "type": "function",
                "function": {"name": name, "arguments": item.get("arguments") or "{}"},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the same turn's text and calls
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"input[{i}]: a function_call_output needs call_id", "input")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": output})
        elif kind not in SKIPPED_ITEMS:
            raise RequestError(
                f"input[{i}]: items of type {kind!r} are not served (message, function_call, "
                "function_call_output, reasoning)",
                "input",
            )
    if not messages:
        raise RequestError("input holds no message", "input")
    return messages


def chat_tool(tool: Any, index: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise RequestError(
            f"tools[{index}]: only function tools with a name are served (got {kind!r})", "tools"
        )
    function = {k: tool[k] for k in ("name", "description", "parameters") if tool.get(k) is not None}
    return {"type": "function", "function": function}


def chat_tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    return choice


def answer_message(answer: Answer) -> dict[str, Any]:
    """The answer as the assistant message a later ``previous_response_id`` request continues."""
    message: dict[str, Any] = {"role": "assistant", "content": answer.content}
    if answer.calls:
        message["tool_calls"] = answer.calls
    return message


def response_body(request: ResponsesRequest, answer: Answer, response_id: str) -> dict[str, Any]:
    """The ``response`` object of `answer`."""
    output: list[dict[str, Any]] = []
    if answer.content is not None:
        output.append(
            {
                "type": "message",
                "id": f"msg_{secrets.token_hex(12)}",
                "status": "completed",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": answer.content, "annotations": [], "logprobs": []}
                ],
            }
        )
    for call in answer.calls:
        output.append(
            {
                "type": "function_call",
                "id": f"fc_{secrets.token_hex(12)}",
                "call_id": call["id"],
                "name": call["function"]["name"],
                "arguments": call["function"]["arguments"],
                "status": "completed",
            }
        )
    incomplete = answer.finish == "length"
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": answer.model,
        "instructions": request.instructions,
        "output": output,
        "parallel_tool_calls": True,
        "previous_response_id": request.previous_response_id,
        "tool_choice": request.tool_choice,
        "tools": request.tools,
        "metadata": {},
        "usage": {
            "input_tokens": answer.prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": answer.sampled,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": answer.prompt_tokens + answer.sampled,
        },
    }


def response_events(body: dict[str, Any]) -> list[str]:
    """`body` (a finished response) as Responses server-sent events."""
    events: list[str] = []

    def event(kind: str, **data: Any) -> None:
        payload = {"type": kind, "sequence_number": len(events), **data}
        events.append(f"event: {kind}\ndata: {json.dumps(payload)}\n\n")

    event("response.created", response={**body, "status": "in_progress", "output": [], "usage": None})
    event("response.in_progress", response={**body, "status": "in_progress", "output": [], "usage": None})
    for index, item in enumerate(body["output"]):
        at = {"output_index": index, "item_id": item["id"]}
        if item["type"] == "message":
            part = item["content"][0]
            event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "content": []},
            )
            event("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            event("response.output_text.delta", **at, content_index=0, delta=part["text"], logprobs=[])
            event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            event("response.content_part.done", **at, content_index=0, part=part)
        else:
            event(
                "response.output_item.added",
                output_index=index,
                item={**item, "status": "in_progress", "arguments": ""},
            )
            event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            event(
                "response.function_call_arguments.done", **at, name=item["name"], arguments=item["arguments"]
            )
        event("response.output_item.done", output_index=index, item=item)
    event("response.completed" if body["status"] == "completed" else "response.incomplete", response=body)
    return events


def new_response_id() -> str:
    return f"resp_{secrets.token_hex(16)}"
