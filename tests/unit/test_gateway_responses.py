"""The gateway's ``/v1/responses`` (OpenAI's Responses API): real HTTP on 127.0.0.1, the real
``openai`` client's ``responses.create`` / ``responses.stream``, a scripted engine. The calls are
recorded as the engine sampled them and merge into the template's rendering of the conversation,
as chat completions do; ``previous_response_id`` continues a response of the same session; what
the gateway does not serve gets a 400 naming it."""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp
import pytest
from agentic_fakes import (
    CHATML_TOOLS_TEMPLATE,
    MULTIPLY_ANSWER,
    MULTIPLY_CALL,
    MULTIPLY_PROMPT,
    Reply,
    Row,
    ScriptedEngine,
    chatml_tokenizer,
    llama3_tokenizer,
    token_ids,
)

from skylift.gateway import Budget, Session
from skylift.gateway.rollouts import HarnessRollouts, HarnessSettings
from skylift.generator import Generator, GeneratorSettings
from skylift.inference.types import SamplingParams

AGENTS = [
    "gateway_responses_agents:responses_tool_loop",
    "gateway_responses_agents:chained_responses_tool_loop",
    "gateway_responses_agents:streamed_responses_tool_loop",
]


def _rollouts(tokenizer: Any, replies: list[Reply], agent: str) -> tuple[HarnessRollouts, ScriptedEngine]:
    engine = ScriptedEngine(replies)
    generator = Generator(engine, tokenizer, GeneratorSettings(max_generate_length=64, max_prompt_length=512))
    settings = HarnessSettings(entrypoint=agent, tool_parser="hermes", verifier="env")
    return HarnessRollouts(generator, settings, default_env_class="calculator"), engine


def _generate(rollouts: HarnessRollouts, rows: list[Row]) -> list[Any]:
    async def go() -> list[Any]:
        try:
            return await rollouts.generate(rows, 1, SamplingParams(max_tokens=64), 3, None)
        finally:
            await rollouts.aclose()

    return asyncio.run(go())


@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("agent", AGENTS)
def test_responses_calls_are_the_samples_and_merge_into_the_template_rendering(
    template: str, agent: str
) -> None:
    from gateway_agents import MULTIPLY

    tokenizer = chatml_tokenizer(CHATML_TOOLS_TEMPLATE) if template == "chatml" else llama3_tokenizer()
    eos = tokenizer.eos_token_id
    replies = [
        Reply(token_ids(tokenizer, MULTIPLY_CALL) + [eos]),
        Reply(token_ids(tokenizer, MULTIPLY_ANSWER) + [eos]),
    ]
    sampled = [list(r.token_ids) for r in replies]
    rollouts, engine = _rollouts(tokenizer, replies, agent)
    (trajectory,) = _generate(
        rollouts, [Row(MULTIPLY_PROMPT, "calculator", reward_spec={"ground_truth": "408"})]
    )
    assert trajectory.reward == 1.0 and trajectory.metrics["harness_calls"] == 2.0
    assert trajectory.metrics["harness_tool_calls"] == 1.0
    # one sequence: the first prompt, then exactly the sampled ids (trained) and what lies between
    assert trajectory.prompt_ids == engine.prompts[0]
    trained = [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m]
    assert trained == sum(sampled, [])
    # ... and the second call's prompt went on from the first call's ids as sampled
    assert engine.prompts[1][: len(engine.prompts[0]) + len(sampled[0])] == engine.prompts[0] + sampled[0]
    final = [
        *MULTIPLY_PROMPT,
        {"role": "assistant", "content": MULTIPLY_CALL},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": MULTIPLY_ANSWER},
    ]
    tools = None if template == "llama3" else [MULTIPLY]
    rendered = [
        int(t) for t in tokenizer.apply_chat_template(final, tools=tools, tokenize=True, return_dict=False)
    ]
    close = {"chatml": token_ids(tokenizer, "\n"), "llama3": []}[template]
    assert trajectory.prompt_ids + trajectory.response_ids + close == rendered


def test_a_response_object_holds_the_text_the_calls_usage_and_an_incomplete_status() -> None:
    tokenizer = chatml_tokenizer(CHATML_TOOLS_TEMPLATE)
    eos = tokenizer.eos_token_id
    replies = [
        Reply(token_ids(tokenizer, "Let me compute. " + MULTIPLY_CALL) + [eos]),
        Reply(token_ids(tokenizer, "The answer is"), stop_reason="length"),
    ]
    rollouts, _ = _rollouts(tokenizer, replies, AGENTS[0])
    tool = {"type": "function", "name": "multiply", "parameters": {"type": "object"}}

    async def go() -> list[dict[str, Any]]:
        await rollouts.gateway.start()
        session = Session(SamplingParams(max_tokens=64), 0, Budget())
        url = rollouts.gateway.open(session)
        bodies = [
            {"model": "m", "instructions": "You can multiply.", "input": "What is 12 * 34?", "tools": [tool]},
            {"model": "m", "input": "And 1 * 1?", "max_output_tokens": 3},
        ]
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for body in bodies:
                async with http.post(url + "/responses", json=body) as resp:
                    assert resp.status == 200
                    out.append(await resp.json())
        await rollouts.aclose()
        return out

    first, second = asyncio.run(go())
    assert (
        first["object"] == "response" and first["status"] == "completed" and first["id"].startswith("resp_")
    )
    message, call = first["output"]
    assert message["type"] == "message" and message["content"][0]["text"] == "Let me compute."
    assert call["type"] == "function_call" and call["name"] == "multiply"
    assert call["arguments"] == '{"a": 12, "b": 34}' and call["call_id"].startswith("call_")
    assert first["usage"]["output_tokens"] == len(replies[0].token_ids)
    assert first["instructions"] == "You can multiply." and first["tools"] == [tool]
    assert second["status"] == "incomplete" and second["incomplete_details"] == {
        "reason": "max_output_tokens"
    }
    assert second["output"][0]["content"][0]["text"] == "The answer is"


def test_responses_requests_the_gateway_does_not_serve_get_a_400_naming_what() -> None:
    tokenizer = chatml_tokenizer()
    rollouts, engine = _rollouts(tokenizer, [], AGENTS[0])
    bodies = [
        ({"input": []}, "input"),
        ({"input": 3}, "input must be a string"),
        ({"input": [{"type": "image_generation_call"}]}, "'image_generation_call' are not served"),
        ({"input": [{"role": "robot", "content": "hi"}]}, "role must be"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "call_id"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools"),
        ({"input": "hi", "previous_response_id": "resp_nope"}, "previous_response_id"),
        ({"input": "hi", "instructions": 7}, "instructions"),
        ({"input": "hi", "max_output_tokens": 0}, "max_output_tokens must be a positive integer"),
        ({"input": [{"role": "user", "content": [{"type": "input_image"}]}]}, "text"),
        ({"input": "hi", "stream": "yes"}, "stream"),
    ]

    async def go() -> list[tuple[int, str]]:
        await rollouts.gateway.start()
        session = Session(SamplingParams(max_tokens=8), 0, Budget())
        url = rollouts.gateway.open(session)
        out = []
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for body, _ in bodies:
                async with http.post(url + "/responses", json=body) as resp:
                    out.append((resp.status, (await resp.json())["error"]["message"]))
            async with http.post(url + "/responses", data=b"[") as resp:
                out.append((resp.status, (await resp.json())["error"]["message"]))
            async with http.post(url + "/conversations", json={}) as resp:
                out.append((resp.status, (await resp.json())["error"]["message"]))
        await rollouts.aclose()
        return out

    answers = asyncio.run(go())
    assert [status for status, _ in answers] == [400] * (len(bodies) + 1) + [404]
    for (_, message), (_, words) in zip(answers, bodies, strict=False):
        assert words in message, (words, message)
    assert "JSON" in answers[len(bodies)][1] and "responses" in answers[-1][1]
    assert engine.prompts == []  # none of them reached the engine
