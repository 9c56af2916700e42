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

Each rollout has a client of its own (as the demo's agent), all sharing one SSL context: a fresh
``AsyncOpenAI`` loads the CA bundle, about 50 ms of CPU per rollout; and one client shared by all
rollouts is slower still (httpx's pool scans all its connections for every request it places: with
64 rollouts at once, 8 ms of CPU per call instead of 4). Both are the agent's costs, not the
gateway's.
"""

from __future__ import annotations

import inspect
import ssl
from typing import Any

from openai import AsyncOpenAI, DefaultAsyncHttpxClient

from skylift.envs import make_env

_SSL: list[ssl.SSLContext] = []  # built once: a fresh client would load the CA bundle again


def _client(base_url: str) -> AsyncOpenAI:
    """A client of its own per rollout (one connection, as the demo's agent has), sharing the SSL
    context (building it is ~50 ms of CPU)."""
    if not _SSL:
        _SSL.append(ssl.create_default_context())
    http = DefaultAsyncHttpxClient(verify=_SSL[0], timeout=120.0)
    return AsyncOpenAI(base_url=base_url, api_key="unused", http_client=http)


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
    client = _client(base_url)
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
        await client.close()
    return {"reward": reward, "output": text, "metrics": metrics}
