"""Agent programs the gateway tests run: plain ``openai``-client code, as a user would write it."""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI, OpenAI

MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


async def tool_loop(task: dict[str, Any], base_url: str, stream: bool = False) -> dict[str, Any]:
    """Call the model, run its multiply calls, until it answers without one (at most 4 calls)."""
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    messages: list[dict[str, Any]] = list(task["prompt"])
    try:
        for _ in range(4):
            if stream:
                message = await _streamed(client, messages)
            else:
                answer = await client.chat.completions.create(
                    model="policy", messages=messages, tools=[MULTIPLY]
                )
                message = answer.choices[0].message.model_dump(exclude_none=True)
            messages.append(message)
            calls = message.get("tool_calls") or []
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                messages.append(
                    {"role": "tool", "tool_call_id": call["id"], "content": str(args["a"] * args["b"])}
                )
            if not calls:
                return {"output": message.get("content") or "", "metadata": {"messages": messages}}
    finally:
        await client.close()
    return {"output": "", "metadata": {"messages": messages}}


async def _streamed(client: AsyncOpenAI, messages: list[dict[str, Any]]) -> dict[str, Any]:
    content, calls = "", []
    events = await client.chat.completions.create(
        model="policy", messages=messages, tools=[MULTIPLY], stream=True
    )
    async for chunk in events:
        delta = chunk.choices[0].delta if chunk.choices else None
        if delta is None:
            continue
        content += delta.content or ""
        for call in delta.tool_calls or []:
            calls.append({"id": call.id, "type": "function", "function": call.function.model_dump()})
    message: dict[str, Any] = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = calls
    return message


async def streamed_tool_loop(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    return await tool_loop(task, base_url, stream=True)


def sync_reward(task: dict[str, Any], base_url: str) -> float:
    """A sync entry point that computes its own reward: 1 when the answer holds the truth."""
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    text = client.chat.completions.create(model="policy", messages=task["prompt"]).choices[0].message.content
    return float(task["reward_spec"]["ground_truth"] in (text or ""))


async def crash_after_one_call(task: dict[str, Any], base_url: str) -> float:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=30)
    await client.chat.completions.create(model="policy", messages=task["prompt"])
    await client.close()
    raise RuntimeError("the agent fell over")


def crash_at_once(task: dict[str, Any], base_url: str) -> float:
    raise KeyError("no such thing")


def contains_truth(task: dict[str, Any], output: str | None, workdir: str) -> dict[str, Any]:
    """A verifier: 1 when the output holds the ground truth."""
    return {
        "reward": float(task["reward_spec"]["ground_truth"] in (output or "")),
        "metrics": {"verified": 1.0},
    }
