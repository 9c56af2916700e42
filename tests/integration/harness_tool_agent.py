"""A plain `openai`-client tool loop (no skylift import), the agent of test_harness.py: it offers
one tool, runs the calls it gets back, and asks a second time ("Again.") before it answers."""

from __future__ import annotations

import json
from typing import Any

from openai import AsyncOpenAI

ECHO = {
    "type": "function",
    "function": {
        "name": "echo",
        "description": "Repeat a text.",
        "parameters": {"type": "object", "properties": {"text": {"type": "string"}}, "required": []},
    },
}


async def run(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    client = AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    messages: list[dict[str, Any]] = list(task["prompt"])
    try:
        for turn in range(2):
            reply = await client.chat.completions.create(
                model="policy", messages=messages, tools=[ECHO], max_tokens=12
            )
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                text = json.loads(call.function.arguments or "{}").get("text", "")
                messages.append({"role": "tool", "tool_call_id": call.id, "content": str(text)})
            if turn == 0 and not message.tool_calls:
                messages.append({"role": "user", "content": "Again."})
    finally:
        await client.close()
    return {"output": messages[-1].get("content") or "", "metrics": {"agent_turns": 2.0}}


def even_length(task: dict[str, Any], output: str | None, workdir: str) -> float:
    """The verifier: 1 for an answer of even length (random for the untrained tiny model)."""
    return float(len(output or "") % 2 == 0)
