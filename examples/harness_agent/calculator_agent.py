"""A calculator agent written against the plain `openai` client: no skylift import.

It is the agent of `skylift demo --task harness`: skylift reaches it only through the gateway URL
it is given. Per task it sends the conversation (`task["prompt"]`) with one tool, `calculator`,
runs the calls the model makes with its own arithmetic, sends the results back as `tool`
messages, and stops at the first answer without a call (at most `MAX_CALLS` model calls).

Two ways to run it:

- as a Python entry point, `environment.harness.entrypoint=examples/harness_agent/calculator_agent.py:solve`:
  `solve(task, base_url)` returns the final answer and whether a tool was used;
- as a command, `python calculator_agent.py` in a directory holding `task.json`, with
  `OPENAI_BASE_URL` (and `OPENAI_API_KEY`) set: it prints the final answer.

Either way the reward comes from a verifier (`environment.harness.verifier=env`: the row's
`calculator` environment scores the answer `#### n`).
"""

from __future__ import annotations

import ast
import asyncio
import json
import operator
import os
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

MAX_CALLS = 3
MODEL = os.environ.get("OPENAI_MODEL", "policy")
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string", "description": 'for example "12 * 345"'}},
            "required": ["expression"],
        },
    },
}
_OPS: dict[type, Any] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def calculate(expression: str) -> str:
    """`expression` (numbers, + - * / and parentheses) evaluated, or an error message."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        raise ValueError("only numbers, + - * / and parentheses")

    try:
        result = value(ast.parse(expression.replace("x", "*").strip(), mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as exc:
        return f"error: {exc}"
    return str(int(result)) if float(result).is_integer() else str(round(result, 6))


def run_tool(call: Any) -> str:
    if call.function.name != "calculator":
        return f"error: unknown tool {call.function.name!r}"
    try:
        args = json.loads(call.function.arguments or "{}")
        return calculate(str(args["expression"]))
    except (ValueError, KeyError, TypeError) as exc:
        return f"error: bad arguments: {exc}"


async def solve(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    """The agent loop for one task; the final answer and whether it called the calculator."""
    client = AsyncOpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "unused"), timeout=120)
    messages: list[dict[str, Any]] = list(task["prompt"])
    used_tool = False
    try:
        for _ in range(MAX_CALLS):
            reply = await client.chat.completions.create(model=MODEL, messages=messages, tools=[CALCULATOR])
            message = reply.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                return {"output": message.content or "", "metrics": {"used_tool": float(used_tool)}}
            used_tool = True
            for call in message.tool_calls:
                messages.append({"role": "tool", "tool_call_id": call.id, "content": run_tool(call)})
    finally:
        await client.close()
    return {"output": "", "metrics": {"used_tool": float(used_tool)}}  # still calling: no answer


if __name__ == "__main__":
    answer = asyncio.run(solve(json.loads(Path("task.json").read_text()), os.environ["OPENAI_BASE_URL"]))
    print(answer["output"])
