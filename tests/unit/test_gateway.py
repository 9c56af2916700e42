"""The gateway (`skylift.gateway`): real HTTP on 127.0.0.1, real ``openai`` clients, a scripted
engine. Every captured call's ids are the engine's samples; the merged sequence is
``apply_chat_template`` of the final conversation (ChatML with tools, Llama 3); budgets end a
rollout with a reason; a crashing or hanging agent scores 0 and the run goes on."""

from __future__ import annotations

import asyncio
import logging
import sys
from pathlib import Path
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

from skylift.gateway import Budget
from skylift.gateway.rollouts import HarnessRollouts, HarnessSettings
from skylift.generator import Generator, GeneratorSettings
from skylift.inference.types import SamplingParams

HERE = Path(__file__).parent
PROMPT, CALL, ANSWER = MULTIPLY_PROMPT, MULTIPLY_CALL, MULTIPLY_ANSWER
_ids = token_ids


def _rollouts(tokenizer: Any, replies: list[Reply], **harness: Any) -> tuple[HarnessRollouts, ScriptedEngine]:
    engine = ScriptedEngine(replies)
    generator = Generator(engine, tokenizer, GeneratorSettings(max_generate_length=64, max_prompt_length=512))
    settings = HarnessSettings(**{"entrypoint": "gateway_agents:tool_loop", **harness})
    return HarnessRollouts(generator, settings, default_env_class="calculator"), engine


def _generate(
    rollouts: HarnessRollouts, rows: list[Row], n: int = 1, seeds: list[int] | None = None
) -> list[Any]:
    async def go() -> list[Any]:
        try:
            return await rollouts.generate(rows, n, SamplingParams(max_tokens=64), 3, seeds)
        finally:
            await rollouts.aclose()

    return asyncio.run(go())


def _row(truth: str = "408") -> Row:
    return Row(PROMPT, "calculator", reward_spec={"ground_truth": truth})


@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("agent", ["gateway_agents:tool_loop", "gateway_agents:streamed_tool_loop"])
def test_captured_ids_are_the_samples_and_merge_into_the_template_rendering(
    template: str, agent: str
) -> None:
    tokenizer = chatml_tokenizer(CHATML_TOOLS_TEMPLATE) if template == "chatml" else llama3_tokenizer()
    eos = tokenizer.eos_token_id
    replies = [Reply(_ids(tokenizer, CALL) + [eos]), Reply(_ids(tokenizer, ANSWER) + [eos])]
    sampled = [list(r.token_ids) for r in replies]
    rollouts, engine = _rollouts(tokenizer, replies, entrypoint=agent, tool_parser="hermes", verifier="env")
    captured: list[Any] = []
    complete = rollouts.gateway.complete

    async def recording(session: Any, request: Any) -> Any:
        answer = await complete(session, request)
        captured.append(session.calls[-1])
        return answer

    rollouts.gateway.complete = recording  # type: ignore[method-assign]
    (trajectory,) = _generate(rollouts, [_row()])
    # every call: the ids sent to the engine, and exactly the ids it sampled
    assert [c.prompt_ids for c in captured] == engine.prompts
    assert [c.sampled_ids for c in captured] == sampled
    assert [c.policy_version for c in captured] == [3, 3]
    # the second call extends the first: one sequence, loss only on the sampled ids
    assert trajectory.reward == 1.0 and trajectory.metrics["harness_calls"] == 2.0
    assert trajectory.metrics["harness_tool_calls"] == 1.0 and trajectory.metrics["correct"] == 1.0
    merged = trajectory.prompt_ids + trajectory.response_ids
    assert trajectory.prompt_ids == engine.prompts[0]
    assert [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m] == sum(
        sampled, []
    )
    assert trajectory.rollout_logprobs.count(-0.5) == sum(map(len, sampled))
    # ... and equals the template's rendering of the final conversation (the sampled turns as text)
    final = [
        *PROMPT,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": ANSWER},
    ]
    rendered = [
        int(t)
        for t in tokenizer.apply_chat_template(
            final, tools=None if template == "llama3" else [_tool()], tokenize=True, return_dict=False
        )
    ]
    close = {"chatml": _ids(tokenizer, "\n"), "llama3": []}[template]
    assert merged + close == rendered


def _tool() -> dict[str, Any]:
    from gateway_agents import MULTIPLY

    return MULTIPLY


def test_the_agent_is_answered_in_openai_format_with_tool_calls() -> None:
    tokenizer = chatml_tokenizer(CHATML_TOOLS_TEMPLATE)
    eos = tokenizer.eos_token_id
    replies = [
        Reply(_ids(tokenizer, "Let me compute. " + CALL) + [eos]),
        Reply(_ids(tokenizer, ANSWER) + [eos]),
    ]
    rollouts, _ = _rollouts(tokenizer, replies, verifier="gateway_agents:contains_truth")
    (trajectory,) = _generate(rollouts, [_row()])
    assert trajectory.reward == 1.0 and trajectory.metrics["verified"] == 1.0
    messages = trajectory.env_metadata["messages"]
    call = messages[2]
    assert call["content"] == "Let me compute." and call["tool_calls"][0]["function"] == {
        "name": "multiply",
        "arguments": '{"a": 12, "b": 34}',
    }
    assert call["tool_calls"][0]["id"].startswith("call_") and messages[3]["content"] == "408"
    assert messages[-1] == {"role": "assistant", "content": ANSWER}


def test_an_agent_without_a_reward_or_a_verifier_is_an_error() -> None:
    tokenizer = chatml_tokenizer()
    rollouts, _ = _rollouts(tokenizer, [Reply(_ids(tokenizer, ANSWER) + [tokenizer.eos_token_id])])
    (trajectory,) = _generate(rollouts, [_row()])
    assert trajectory.reward == 0.0
    assert "no reward" in trajectory.env_metadata["harness_error"]


def test_a_call_over_the_budget_gets_an_http_error_naming_it_and_ends_the_rollout() -> None:
    tokenizer = chatml_tokenizer(CHATML_TOOLS_TEMPLATE)
    eos = tokenizer.eos_token_id
    replies = [Reply(_ids(tokenizer, CALL) + [eos])] * 3
    rollouts, engine = _rollouts(tokenizer, replies, budget=Budget(max_calls=2), verifier="env")
    trajectories = _generate(rollouts, [_row()])
    assert len(engine.prompts) == 2  # the third call never reached the engine
    last = trajectories[-1]
    assert "max_calls=2" in last.env_metadata["gateway_stop"]
    assert "budget_exceeded" in last.env_metadata["harness_error"]  # the agent's openai client raised
    assert last.stop_reason == "length" and last.reward == 0.0
    assert last.metrics["harness_budget_stops"] == 1.0


def test_the_token_budget_cuts_a_call_and_then_refuses_the_next() -> None:
    tokenizer = chatml_tokenizer(CHATML_TOOLS_TEMPLATE)
    eos = tokenizer.eos_token_id
    call = _ids(tokenizer, CALL) + [eos]
    rollouts, engine = _rollouts(
        tokenizer, [Reply(call), Reply(call)], budget=Budget(max_tokens=len(call) + 3)
    )
    (*_, last) = _generate(rollouts, [_row()])
    assert len(engine.prompts) == 2
    assert last.loss_mask.count(1) == len(call) + 3  # the second call sampled only what was left
    rollouts, engine = _rollouts(tokenizer, [Reply(call), Reply(call)], budget=Budget(max_tokens=len(call)))
    (last,) = _generate(rollouts, [_row()])
    assert len(engine.prompts) == 1
    assert "max_tokens=" in last.env_metadata["gateway_stop"] and last.stop_reason == "length"


def _session_url(rollouts: HarnessRollouts) -> tuple[Any, str]:
    from skylift.gateway import Session

    session = Session(SamplingParams(max_tokens=8), 0, Budget())
    return session, rollouts.gateway.open(session)


def test_bad_requests_get_a_400_naming_the_field_and_unknown_sessions_a_404() -> None:
    tokenizer = chatml_tokenizer()
    rollouts, _ = _rollouts(tokenizer, [])

    async def go() -> list[tuple[int, str]]:
        await rollouts.gateway.start()
        session, url = _session_url(rollouts)
        out = []
        bodies = [
            {"messages": []},
            {"messages": [{"role": "user", "content": "hi"}], "n": 2},
            {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]},
            {"messages": [{"role": "user", "content": "hi"}], "tool_choice": "sometimes"},
            {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        ]
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as http:
            for body in bodies:
                async with http.post(url + "/chat/completions", json=body) as resp:
                    out.append((resp.status, (await resp.json())["error"]["message"]))
            async with http.post(url + "/chat/completions", data=b"{not json") as resp:
                out.append((resp.status, (await resp.json())["error"]["message"]))
            async with http.get(url + "/models") as resp:
                out.append((resp.status, (await resp.json())["data"][0]["id"]))
            rollouts.gateway.close(session)
            async with http.get(url + "/models") as resp:
                out.append((resp.status, (await resp.json())["error"]["message"]))
        await rollouts.aclose()
        return out

    answers = asyncio.run(go())
    assert [status for status, _ in answers] == [400] * 6 + [200, 404]
    for (_, message), word in zip(
        answers, ["messages", "n must be 1", "tools", "tool_choice", "text", "JSON"], strict=False
    ):
        assert word in message
    assert answers[6][1] == "policy"
    assert "unknown or finished" in answers[7][1]


def test_a_crashing_agent_scores_zero_with_its_error_logged(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = chatml_tokenizer()
    eos = tokenizer.eos_token_id
    rollouts, _ = _rollouts(
        tokenizer, [Reply(_ids(tokenizer, "hello") + [eos])], entrypoint="gateway_agents:crash_after_one_call"
    )
    with caplog.at_level(logging.WARNING, logger="skylift.gateway"):
        (trajectory,) = _generate(rollouts, [_row()])
    assert trajectory.reward == 0.0 and trajectory.metrics["harness_errors"] == 1.0
    assert "the agent fell over" in trajectory.env_metadata["harness_error"]
    assert trajectory.loss_mask == [1] * (len(_ids(tokenizer, "hello")) + 1)  # what it sampled still counts
    assert any("the agent fell over" in r.getMessage() for r in caplog.records)


def test_an_agent_that_crashes_before_any_call_keeps_its_place_and_trains_nothing() -> None:
    tokenizer = chatml_tokenizer()
    eos = tokenizer.eos_token_id
    replies = [Reply(_ids(tokenizer, "408") + [eos])]
    rollouts, _ = _rollouts(tokenizer, replies, entrypoint="gateway_agents:crash_at_once")
    (trajectory,) = _generate(rollouts, [_row()])
    assert trajectory.reward == 0.0 and trajectory.loss_mask == [0] and trajectory.last_step
    assert "KeyError" in trajectory.env_metadata["harness_error"]


def test_a_sync_entry_point_returns_its_own_reward_and_seeds_follow_the_rows() -> None:
    tokenizer = chatml_tokenizer()
    eos = tokenizer.eos_token_id
    replies = [Reply(_ids(tokenizer, "It is 408.") + [eos]), Reply(_ids(tokenizer, "It is 400.") + [eos])]
    rollouts, _ = _rollouts(tokenizer, replies, entrypoint="gateway_agents:sync_reward", max_concurrent=1)
    seen: list[int | None] = []
    generate = rollouts.gateway.engine.generate

    async def recording(prompts: Any, params: SamplingParams, session_id: Any = None) -> Any:
        seen.append(params.seed)
        return await generate(prompts, params, session_id)

    rollouts.gateway.engine.generate = recording  # type: ignore[method-assign]
    trajectories = _generate(rollouts, [_row()], n=2, seeds=[100])
    assert sorted(tr.reward for tr in trajectories) == [0.0, 1.0]
    assert seen == [100, 101]  # sample j of a row: the row's seed + j
    assert len({tr.trajectory_id for tr in trajectories}) == 2


@pytest.mark.parametrize(
    ("mode", "reward", "error"),
    [("ok", 1.0, None), ("fail", 0.0, "exited with code 3: cannot go on"), ("sleep", 0.0, "timed out")],
)
def test_a_command_line_agent_is_scored_by_its_verifier(mode: str, reward: float, error: str | None) -> None:
    tokenizer = chatml_tokenizer()
    eos = tokenizer.eos_token_id
    rollouts, _ = _rollouts(
        tokenizer,
        [Reply(_ids(tokenizer, "It is 408.") + [eos])],
        entrypoint=None,
        command=[sys.executable, str(HERE / "gateway_agent_cli.py"), mode],
        verifier="gateway_agents:contains_truth",
        output_file="answer.txt",
        timeout_s=5.0,
    )
    (trajectory,) = _generate(rollouts, [_row()])
    assert trajectory.reward == reward
    got = trajectory.env_metadata.get("harness_error")
    assert got == error if error is None else got is not None and got.endswith(error)
    if error is None:
        assert trajectory.metrics["verified"] == 1.0


def test_harness_settings_that_cannot_work_are_refused_naming_the_keys() -> None:
    from skylift.config import ConfigError, load_config

    with pytest.raises(ConfigError) as caught:
        load_config(
            [
                "environment.harness.entrypoint=no_colon",
                "environment.harness.command=[python,agent.py]",
                "environment.harness.verifier=nowhere",
            ]
        )
    text = str(caught.value)
    assert "entrypoint and environment.harness.command are exclusive" in text
    assert "entrypoint='no_colon' must be module:function" in text
    assert "verifier='nowhere' must be env or module:function" in text
    with pytest.raises(ConfigError, match="command needs environment.harness.verifier"):
        load_config(["environment.harness.command=[python,agent.py]"])
    with pytest.raises(ConfigError, match="output_file is set but neither"):
        load_config(["environment.harness.output_file=out.txt"])
    with pytest.raises(ValueError, match="cannot import"):
        HarnessRollouts(
            Generator(ScriptedEngine([]), chatml_tokenizer(), GeneratorSettings()),
            HarnessSettings(entrypoint="no_such_module_xyz:run"),
            "calculator",
        )


def test_routing_replay_refuses_a_call_the_engine_did_not_route() -> None:
    """With routing replay on, a gateway call whose sample comes without routed experts is the
    agent's error naming why (its rows would otherwise train on the trainer's own routing)."""
    tokenizer = chatml_tokenizer()
    engine = ScriptedEngine([Reply(_ids(tokenizer, ANSWER) + [tokenizer.eos_token_id])])
    settings = GeneratorSettings(max_generate_length=64, max_prompt_length=512, routed_experts=True)
    generator = Generator(engine, tokenizer, settings)
    harness = HarnessSettings(entrypoint="gateway_agents:tool_loop", verifier="env")
    rollouts = HarnessRollouts(generator, harness, default_env_class="calculator")
    (trajectory,) = _generate(rollouts, [_row()])
    assert trajectory.reward == 0.0
    assert "returned no routed experts" in trajectory.env_metadata["harness_error"], trajectory.env_metadata
