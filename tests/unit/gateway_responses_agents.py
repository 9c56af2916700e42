"""Agent programs over the OpenAI *Responses* API that the gateway tests run: plain ``openai``
client code (``client.responses``), as a user would write it."""

from __future__ import annotations

import json
from typing import Any

from gateway_agents import MULTIPLY as CHAT_MULTIPLY
from openai import AsyncOpenAI

#: the chat agents' multiply tool in the Responses API's flat form
MULTIPLY = {"type": "function", **CHAT_MULTIPLY["function"]}


def _client(base_url: str) -> AsyncOpenAI:
    return AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)


def _instructions_and_input(task: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]]]:
    messages = list(task["prompt"])
    if messages and messages[0]["role"] == "system":
        return messages[0]["content"], messages[1:]
    return None, messages


def _outputs(calls: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "type": "function_call_output",
            "call_id": call.call_id,
            "output": str(json.loads(call.arguments)["a"] * json.loads(call.arguments)["b"]),
        }
        for call in calls
    ]


async def responses_tool_loop(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    """The Responses API's documented loop: send the whole input each time, the response's output
    items appended to it, then the function calls' outputs (at most 4 calls)."""
    client = _client(base_url)
    instructions, items = _instructions_and_input(task)
    try:
        for _ in range(4):
            response = await client.responses.create(
                model="policy", instructions=instructions, input=items, tools=[MULTIPLY]
            )
            items += [item.model_dump(exclude_none=True) for item in response.output]
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return {"output": response.output_text, "metadata": {"items": items}}
            items += _outputs(calls)
    finally:
        await client.close()
    return {"output": "", "metadata": {"items": items}}


async def chained_responses_tool_loop(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    """The same with ``previous_response_id``: each request sends only what is new."""
    client = _client(base_url)
    instructions, items = _instructions_and_input(task)
    previous = None
    try:
        for _ in range(4):
            response = await client.responses.create(
                model="policy",
                instructions=instructions,
                input=items,
                tools=[MULTIPLY],
                previous_response_id=previous,
            )
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return {"output": response.output_text}
            previous, items = response.id, _outputs(calls)
    finally:
        await client.close()
    return {"output": ""}


async def streamed_responses_tool_loop(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    """The documented loop through the SDK's streaming helper (``responses.stream``): the text as
    it comes, then the final response the helper assembles from the events."""
    client = _client(base_url)
    instructions, items = _instructions_and_input(task)
    try:
        for _ in range(4):
            text = ""
            async with client.responses.stream(
                model="policy", instructions=instructions, input=items, tools=[MULTIPLY]
            ) as stream:
                async for event in stream:
                    if event.type == "response.output_text.delta":
                        text += event.delta
                response = await stream.get_final_response()
            assert text == response.output_text, (text, response.output_text)
            items += [item.model_dump(exclude_none=True) for item in response.output]
            calls = [item for item in response.output if item.type == "function_call"]
            if not calls:
                return {"output": response.output_text}
            items += _outputs(calls)
    finally:
        await client.close()
    return {"output": ""}
