"""A tool environment end to end with a scripted engine: the tools reach the chat template, calls
are parsed and run (a timeout each, a concurrency limit), results and errors come back as ``tool``
messages rendered by the template, and nothing a policy writes crashes the rollout."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from agentic_fakes import CHATML_TOOLS_TEMPLATE, Reply, Row, ScriptedEngine, chatml_tokenizer

from skylift.envs import StepResult, register_env, unregister_env
from skylift.envs.rewards import extract_final_answer
from skylift.envs.tools import Tool, ToolEnvironment, ToolRunner
from skylift.generator import Generator, GeneratorSettings, rollout_metrics
from skylift.generator.chat import ChatFormat
from skylift.inference.types import SamplingParams

ENV = "test_calculator"
PROMPT = [{"role": "user", "content": "What is 12 * 34? Use the tools."}]


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


async def nap(seconds: float = 5.0) -> str:
    """Sleep, then say so.

    Args:
        seconds: how long to sleep
    """
    await asyncio.sleep(seconds)
    return "rested"


class Calculator(ToolEnvironment):
    tools = (multiply, divide, nap)
    observed: list[list[dict[str, Any]]] = []  # every step's observations (class-wide, for the test)

    async def step(self, action: str) -> StepResult:
        result = await super().step(action)
        Calculator.observed.append(result.observations)
        return result

    def answer(self, action: str) -> StepResult:
        correct = extract_final_answer(action) == "408"
        self.done = True
        return StepResult([], 1.0 if correct else 0.0, True, {"correct": correct})


@pytest.fixture(autouse=True)
def _env() -> Iterator[None]:
    register_env(ENV)(Calculator)
    Calculator.observed = []
    yield
    unregister_env(ENV)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return chatml_tokenizer(CHATML_TOOLS_TEMPLATE)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)] + [tokenizer.eos_token_id]


TURNS = [
    '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>',
    '<tool_call>{"name": "divide", "arguments": {"a": 1, "b": 0}}</tool_call>'
    '<tool_call>{"name": "nap", "arguments": {}}</tool_call>'
    '<tool_call>{"name": "sqrt", "arguments": {"x": 2}}</tool_call>'
    '<tool_call>{"name": "multiply", "arguments": {"a": 1</tool_call>',
    "12 * 34 = 408\n#### 408",
]


def _run(tokenizer: Any, **settings: Any) -> Any:
    engine = ScriptedEngine([Reply(_ids(tokenizer, text)) for text in TURNS])
    generator = Generator(
        engine,
        tokenizer,
        GeneratorSettings(
            max_turns=4, max_prompt_length=2048, max_generate_length=512, tool_timeout_s=0.3, **settings
        ),
    )
    (trajectory,) = asyncio.run(generator.generate([Row(PROMPT, ENV)], 1, SamplingParams(max_tokens=512)))
    return trajectory


def test_tools_reach_the_template_and_the_rollout_is_its_rendering(tokenizer: Any) -> None:
    trajectory = _run(tokenizer)
    schemas = Calculator().tool_schemas()
    assert [s["function"]["name"] for s in schemas] == ["multiply", "divide", "nap"]
    assert schemas[0]["function"]["parameters"]["required"] == ["a", "b"]
    prompt = tokenizer.decode(trajectory.prompt_ids)
    assert "# Tools" in prompt and '"name": "multiply"' in prompt and "the first factor" in prompt

    conversation = list(PROMPT)
    for turn, text in enumerate(TURNS):
        conversation.append({"role": "assistant", "content": text})
        if turn < len(Calculator.observed) and Calculator.observed[turn]:
            conversation += Calculator.observed[turn]
    rendered = tokenizer.apply_chat_template(conversation, tools=schemas, tokenize=True, return_dict=False)
    close = ChatFormat(tokenizer).turn_close_ids(schemas)
    assert trajectory.prompt_ids + trajectory.response_ids + close[1:] == list(rendered)
    assert trajectory.reward == 1.0 and trajectory.num_turns == 3
    assert "<tool_response>\n408\n</tool_response>" in tokenizer.decode(trajectory.response_ids)


def test_failing_slow_unknown_and_malformed_calls_become_error_messages(tokenizer: Any) -> None:
    trajectory = _run(tokenizer)
    errors = [m["content"] for m in Calculator.observed[1]]
    assert len(errors) == 4
    assert "ZeroDivisionError" in errors[0]
    assert "nap timed out after 0.3 s" in errors[1]
    assert "unknown tool 'sqrt'" in errors[2] and "multiply" in errors[2]
    assert "invalid JSON" in errors[3]
    assert all(e.startswith("error: ") for e in errors)
    m = trajectory.metrics
    assert (m["tool_calls"], m["tool_errors"], m["tool_parse_failures"]) == (4.0, 3.0, 1.0)
    assert 0.3 <= m["tool_time_s"] < 3.0
    logged = rollout_metrics([trajectory])
    assert logged["env/tool_calls"] == 4.0 and logged["env/tool_parse_failures"] == 1.0
    assert logged["reward/turn_3_mean"] == 1.0 and logged["reward/turn_1_mean"] == 0.0


def test_too_many_calls_in_one_turn_are_refused_not_run() -> None:
    tokenizer = chatml_tokenizer()
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 2, "b": 3}}</tool_call>'
    engine = ScriptedEngine([Reply(_ids(tokenizer, call * 3)), Reply(_ids(tokenizer, "#### 408"))])
    settings = GeneratorSettings(max_turns=2, env_kwargs={"max_calls_per_turn": 2})
    (trajectory,) = asyncio.run(
        Generator(engine, tokenizer, settings).generate([Row(PROMPT, ENV)], 1, SamplingParams(max_tokens=256))
    )
    contents = [m["content"] for m in Calculator.observed[0]]
    assert contents[:2] == ["6", "6"] and "at most 2 tool calls per turn; 1 not run" in contents[2]
    assert trajectory.metrics["tool_calls"] == 2.0


def test_the_xml_parser_serves_a_model_without_a_tool_template() -> None:
    tokenizer = chatml_tokenizer()  # tiny-qwen2's template ignores tools=
    turns = ['<tool name="multiply">{"a": 12, "b": 34}</tool>', "#### 408"]
    engine = ScriptedEngine([Reply(_ids(tokenizer, t)) for t in turns])
    settings = GeneratorSettings(max_turns=3, env_kwargs={"tool_parser": "xml"})
    (trajectory,) = asyncio.run(
        Generator(engine, tokenizer, settings).generate([Row(PROMPT, ENV)], 1, SamplingParams(max_tokens=256))
    )
    assert Calculator.observed[0] == [{"role": "tool", "name": "multiply", "content": "408"}]
    assert "<|im_start|>tool\n408<|im_end|>" in tokenizer.decode(trajectory.response_ids)
    assert trajectory.reward == 1.0


def test_the_runner_limits_concurrency_and_times_out() -> None:
    running, peak = 0, 0

    async def slow(x: int) -> int:
        nonlocal running, peak
        running += 1
        peak = max(peak, running)
        await asyncio.sleep(0.05)
        running -= 1
        return x

    tool = Tool.from_schema({"name": "slow", "parameters": {"type": "object", "properties": {"x": {}}}}, slow)
    runner = ToolRunner(timeout_s=1.0, max_concurrency=2)

    async def main() -> list[Any]:
        return await asyncio.gather(*(runner.run(tool, {"x": i}) for i in range(6)))

    tick = time.perf_counter()
    outcomes = asyncio.run(main())
    assert [o.content for o in outcomes] == [str(i) for i in range(6)] and peak == 2
    assert time.perf_counter() - tick >= 0.15  # three waves of two
    assert (
        asyncio.run(runner.run(tool, {"y": 1})).content
        == "error: slow: unknown argument(s) ['y']; it takes ['x']"
    )
    with pytest.raises(ValueError, match="max_concurrency"):
        ToolRunner(max_concurrency=0)
