"""The agent of `gateway_overhead.py`: an `openai`-client program that treats each reply exactly as
skylift's own environment loop does, so that both sides of the benchmark do the same work.

It is examples/harness_agent/calculator_agent.py's loop with the reply handling taken from the
row's environment (the demo's ``calculator``): the reply's text goes to the environment's ``step``
(its tool-call parser, its tools, its error observations, e.g. for a malformed call), the
observations are sent back as they are, and the agent stops where skylift's loop does: the
environment is done or has nothing to say, or ``max_turns`` model calls were made. The tools go
to the chat template as the loop's do (``tools=``); ``tool_choice="none"`` because the environment,
not the gateway, reads the calls out of the text (the gateway would answer a malformed call with
no tool call at all, and take the markup of well-formed ones out of the content). The reward is
the sum of the steps' rewards, as the loop's trajectory reward.

The demo's agent stays as it is (an agent that stops at the first reply without a well-formed
call): run through it, the gateway side makes fewer model calls than the loop for the same seeds.

One HTTP client is shared by all rollouts of an event loop (a fresh ``AsyncOpenAI`` builds an
SSL context: about 50 ms of CPU per rollout, the agent's cost, not the gateway's).
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Any

import httpx
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from skylift.envs import make_env

_CLIENTS: dict[asyncio.AbstractEventLoop, httpx.AsyncClient] = {}


def _http_client() -> httpx.AsyncClient:
    loop = asyncio.get_running_loop()
    for old in [other for other in _CLIENTS if other.is_closed()]:
        del _CLIENTS[old]
    if loop not in _CLIENTS:
        _CLIENTS[loop] = DefaultAsyncHttpxClient(timeout=120.0)
    return _CLIENTS[loop]


async def aclose_clients() -> None:
    """Close the shared HTTP client of the running loop."""
    client = _CLIENTS.pop(asyncio.get_running_loop(), None)
    if client is not None:
        await client.aclose()


async def _call(method: Any, *args: Any) -> Any:
    result = method(*args)
    if inspect.isawaitable(result):
        result = await result
    return result


async def solve(task: dict[str, Any], base_url: str) -> dict[str, Any]:
    """One rollout: ``task["options"]`` holds ``env_class``, ``env_kwargs`` and ``max_turns``."""
    options = task.get("options") or {}
    env = make_env(str(options.get("env_class", "calculator")), **(options.get("env_kwargs") or {}))
    extras = {
        **(task.get("columns") or {}),
        "reward_spec": task.get("reward_spec"),
        "extra_info": task.get("extra_info"),
        "data_source": task.get("data_source"),
    }
    client = AsyncOpenAI(base_url=base_url, api_key="unused", http_client=_http_client())
    reward, text, metrics = 0.0, "", {}
    try:
        messages = list(await _call(env.init, list(task["prompt"]), extras))
        tools = env.tool_schemas()
        choice: dict[str, Any] = {"tools": tools, "tool_choice": "none"} if tools else {}
        for _ in range(int(options.get("max_turns", 1))):
            reply = await client.chat.completions.create(model="policy", messages=messages, **choice)
            text = reply.choices[0].message.content or ""
            result = await _call(env.step, text)
            reward += float(result.reward)
            for name, value in (result.metrics or {}).items():
                metrics[name] = metrics.get(name, 0.0) + float(value)
            if result.done or not result.observations:
                break
            messages += [{"role": "assistant", "content": text}, *map(dict, result.observations)]
    finally:
        await _call(env.close)
    return {"reward": reward, "output": text, "metrics": metrics}
