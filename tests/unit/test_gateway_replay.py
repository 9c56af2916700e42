"""The gateway goes on from a call's sampled ids, not from its text re-tokenised: a call that
continues an earlier call of its session (that call's conversation, its reply, then more
messages) is sent as the earlier call's prompt and sampled ids, then what the chat template
renders after them, as skylift's own loop does; where the template rewrites the earlier turns,
the call's prompt is the template's rendering (a new sample of the rollout)."""

from __future__ import annotations

import asyncio
from typing import Any

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

from skylift.gateway.rollouts import HarnessRollouts, HarnessSettings
from skylift.generator import Generator, GeneratorSettings
from skylift.inference.types import SamplingParams

PROMPT, CALL, ANSWER = MULTIPLY_PROMPT, MULTIPLY_CALL, MULTIPLY_ANSWER
_ids = token_ids


def _spelled(tokenizer: Any, text: str) -> list[int]:
    """`text` one character at a time: ids that decode to `text` but are not its tokenisation."""
    return [t for ch in text for t in _ids(tokenizer, ch)]


def _run(tokenizer: Any, replies: list[Reply]) -> tuple[list[Any], ScriptedEngine]:
    engine = ScriptedEngine(replies)
    generator = Generator(
        engine, tokenizer, GeneratorSettings(max_generate_length=200, max_prompt_length=512)
    )
    rollouts = HarnessRollouts(
        generator,
        HarnessSettings(entrypoint="gateway_agents:tool_loop", tool_parser="hermes", verifier="env"),
        default_env_class="calculator",
    )

    async def go() -> list[Any]:
        try:
            row = Row(PROMPT, "calculator", reward_spec={"ground_truth": "408"})
            return await rollouts.generate([row], 1, SamplingParams(max_tokens=200), 0, None)
        finally:
            await rollouts.aclose()

    return asyncio.run(go()), engine


def test_the_next_call_goes_on_from_the_sampled_ids_not_their_retokenised_text() -> None:
    tokenizer = chatml_tokenizer(CHATML_TOOLS_TEMPLATE)
    eos = tokenizer.eos_token_id
    spelled = _spelled(tokenizer, CALL) + [eos]
    assert spelled[:-1] != _ids(tokenizer, CALL)  # another tokenisation of the same text
    answer = _ids(tokenizer, ANSWER) + [eos]
    (trajectory,), engine = _run(tokenizer, [Reply(spelled), Reply(answer)])
    first, second = engine.prompts
    assert second[: len(first) + len(spelled)] == first + spelled
    # one sequence: the prompt, both samples trained, the template's ids between them untrained
    assert trajectory.prompt_ids == first
    assert trajectory.prompt_ids + trajectory.response_ids == second + answer
    trained = [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m]
    assert trained == spelled + answer
    # ... which reads as the template's rendering of the final conversation
    final = [
        *PROMPT,
        {"role": "assistant", "content": CALL},
        {"role": "tool", "content": "408"},
        {"role": "assistant", "content": ANSWER},
    ]
    from gateway_agents import MULTIPLY

    rendered = tokenizer.apply_chat_template(final, tools=[MULTIPLY], tokenize=False)
    assert tokenizer.decode(second + answer) + "\n" == rendered
    assert trajectory.reward == 1.0


def test_a_template_that_rewrites_the_reply_gets_its_own_rendering_as_a_new_sample() -> None:
    tokenizer = llama3_tokenizer()  # trims message content: the sampled leading spaces go
    eos = tokenizer.eos_token_id
    call = _ids(tokenizer, "  " + CALL) + [eos]
    answer = _ids(tokenizer, ANSWER) + [eos]
    trajectories, engine = _run(tokenizer, [Reply(call), Reply(answer)])
    first, second = engine.prompts
    final = [*PROMPT, {"role": "assistant", "content": "  " + CALL}, {"role": "tool", "content": "408"}]
    expected = tokenizer.apply_chat_template(
        final, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert second == [int(t) for t in expected]
    assert second[: len(first) + len(call)] != first + call
    assert [tr.prompt_ids for tr in trajectories] == [first, second]
    assert [tr.response_ids for tr in trajectories] == [call, answer]
