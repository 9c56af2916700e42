"""Multi-turn rollouts are the chat template's tokens: the ids of a 3-turn conversation (prompt +
response) equal ``apply_chat_template`` of that conversation, for ChatML (tiny-qwen2), Llama 3 and
SmolLM2; sampled ids are kept as sampled; turns ending on a stop string or truncated are closed."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine, chatml_tokenizer, llama3_tokenizer, smollm2_tokenizer

from skylift.envs import Environment, StepResult, register_env, unregister_env
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.chat import ChatFormat
from skylift.inference.types import SamplingParams

ENV = "test_three_turns"
FEEDBACK = ["Not quite. Try 12 * 3 again.", "Closer; show the product."]
REWARDS = [0.25, 0.5, 1.0]
REPLIES = ["I think it is 35.", "Let me recompute: 12 * 3 = 36</answer>", "The answer is 36."]
PROMPT = [
    {"role": "system", "content": "You solve arithmetic."},
    {"role": "user", "content": "What is 12 * 3?"},
]


class ThreeTurns(Environment):
    """Feedback after turns 1 and 2, done after turn 3; reward 0.25, 0.5, 1.0 per turn."""

    def step(self, action: str) -> StepResult:
        turn = self._begin_step()
        if turn < 3:
            return StepResult([{"role": "user", "content": FEEDBACK[turn - 1]}], REWARDS[turn - 1], False)
        self.done = True
        return StepResult([], REWARDS[2], True, metrics={"answers": 1.0})


@pytest.fixture(autouse=True)
def _env() -> Iterator[None]:
    register_env(ENV)(ThreeTurns)
    yield
    unregister_env(ENV)


TOKENIZERS: dict[str, Callable[[], Any]] = {
    "chatml": chatml_tokenizer,
    "llama3": llama3_tokenizer,
    "smollm2": smollm2_tokenizer,
}


@pytest.fixture(scope="module", params=sorted(TOKENIZERS))
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return TOKENIZERS[request.param]()


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _rollout(tokenizer: Any, replies: list[Reply], **settings: Any) -> tuple[Any, ScriptedEngine]:
    engine = ScriptedEngine(replies)
    generator = Generator(
        engine, tokenizer, GeneratorSettings(max_turns=3, max_generate_length=64, **settings)
    )
    (trajectory,) = asyncio.run(generator.generate([Row(PROMPT, ENV)], 1, SamplingParams(max_tokens=64)))
    return trajectory, engine


def _conversation() -> list[dict[str, str]]:
    messages = list(PROMPT)
    for turn, reply in enumerate(REPLIES):
        messages.append({"role": "assistant", "content": reply})
        if turn < 2:
            messages.append({"role": "user", "content": FEEDBACK[turn]})
    return messages


def _replies(tokenizer: Any) -> list[Reply]:
    """Turn 1 ends with the EOS the model sampled, turn 2 on the stop string "</answer>" (no
    EOS sampled), turn 3 with EOS."""
    eos = tokenizer.eos_token_id
    return [
        Reply(_encode(tokenizer, REPLIES[0]) + [eos], matched_stop=eos),
        Reply(_encode(tokenizer, REPLIES[1]), matched_stop="</answer>"),
        Reply(_encode(tokenizer, REPLIES[2]) + [eos], matched_stop=eos),
    ]


def test_three_turns_equal_the_template_rendering(tokenizer: Any) -> None:
    trajectory, engine = _rollout(tokenizer, _replies(tokenizer))
    rendered = [
        int(t) for t in tokenizer.apply_chat_template(_conversation(), tokenize=True, return_dict=False)
    ]
    ids = trajectory.prompt_ids + trajectory.response_ids
    # the template closes the last turn after the EOS the model sampled ("\n" in ChatML): the rest
    close = ChatFormat(tokenizer).turn_close_ids()
    assert ids + close[1:] == rendered
    assert trajectory.num_turns == 3
    # what the engine was sent each turn is the template's rendering up to that assistant header
    for turn, prompt in enumerate(engine.prompts):
        expected = [
            int(t)
            for t in tokenizer.apply_chat_template(
                _conversation()[: 2 + 2 * turn], tokenize=True, add_generation_prompt=True, return_dict=False
            )
        ]
        assert prompt == expected, f"turn {turn + 1}"


def test_sampled_ids_are_trained_and_everything_else_is_not(tokenizer: Any) -> None:
    replies = _replies(tokenizer)
    trajectory, _ = _rollout(tokenizer, replies)
    trained = [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m == 1]
    assert trained == [t for reply in replies for t in reply.token_ids]
    untrained_lp = [
        lp for lp, m in zip(trajectory.rollout_logprobs, trajectory.loss_mask, strict=True) if m == 0
    ]
    assert untrained_lp and all(lp == 0.0 for lp in untrained_lp)
    # the EOS added after the stop string is untrained and sits right after the sampled "</answer>"
    turn2 = _encode(tokenizer, REPLIES[1])
    start = next(
        i for i in range(len(trajectory.response_ids)) if trajectory.response_ids[i : i + len(turn2)] == turn2
    )
    after = start + len(turn2)
    assert trajectory.response_ids[after] == tokenizer.eos_token_id and trajectory.loss_mask[after] == 0


def test_turn_rewards_sit_on_each_turns_last_sampled_token(tokenizer: Any) -> None:
    replies = _replies(tokenizer)
    trajectory, _ = _rollout(tokenizer, replies)
    assert [r for _, r in trajectory.turn_rewards] == REWARDS
    assert trajectory.reward == sum(REWARDS)
    for (index, _), reply in zip(trajectory.turn_rewards, replies, strict=True):
        assert trajectory.response_ids[index] == reply.token_ids[-1]
        assert trajectory.loss_mask[index] == 1
    assert trajectory.metrics == {"answers": 1.0}


def test_without_eos_after_stop_strings_the_observation_follows_the_stop_string() -> None:
    tokenizer = chatml_tokenizer()
    replies = _replies(tokenizer)
    trajectory, _ = _rollout(tokenizer, replies, append_eos_after_stop_str=False)
    turn2 = _encode(tokenizer, REPLIES[1])
    ids = trajectory.response_ids
    start = next(i for i in range(len(ids)) if ids[i : i + len(turn2)] == turn2)
    assert ids[start + len(turn2)] == tokenizer.convert_tokens_to_ids("<|im_start|>")


def test_a_truncated_turn_is_closed_before_the_observation() -> None:
    tokenizer = chatml_tokenizer()
    eos = tokenizer.eos_token_id
    long_reply = _encode(tokenizer, "one two three four five six seven eight nine ten eleven twelve")
    replies = [
        Reply(long_reply),
        Reply(_encode(tokenizer, "ok") + [eos]),
        Reply(_encode(tokenizer, "36") + [eos]),
    ]
    engine = ScriptedEngine(replies)
    generator = Generator(engine, tokenizer, GeneratorSettings(max_turns=3, max_generate_length=5))
    (trajectory,) = asyncio.run(generator.generate([Row(PROMPT, ENV)], 1, SamplingParams(max_tokens=64)))
    first = long_reply[:5]
    assert trajectory.response_ids[:5] == first
    closed = tokenizer.decode(trajectory.response_ids[5:8])
    assert closed.startswith("<|im_end|>\n<|im_start|>"), closed


def test_chat_template_kwargs_reach_the_template() -> None:
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% if not enable_thinking %}"
        "<think>\n\n</think>\n\n{% endif %}{% endif %}"
    )
    tokenizer = chatml_tokenizer(template)
    for kwargs, thinks in (({"enable_thinking": False}, True), ({"enable_thinking": True}, False)):
        engine = ScriptedEngine([Reply(_encode(tokenizer, "#### 36") + [tokenizer.eos_token_id])])
        settings = GeneratorSettings(max_turns=3, chat_template_kwargs=kwargs)
        (trajectory,) = asyncio.run(
            Generator(engine, tokenizer, settings).generate(
                [Row(PROMPT, "arithmetic_multiturn", reward_spec={"ground_truth": "36"})], 1, SamplingParams()
            )
        )
        assert ("<think>" in tokenizer.decode(trajectory.prompt_ids)) is thinks


def test_a_template_that_rewrites_history_is_refused_with_a_clear_error() -> None:
    # renders only the last message: appending observations changes what came before
    tokenizer = chatml_tokenizer(
        "<|im_start|>{{ messages[-1].role }}\n{{ messages[-1].content }}<|im_end|>\n"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    engine = ScriptedEngine([Reply(_encode(tokenizer, "35") + [tokenizer.eos_token_id])])
    generator = Generator(engine, tokenizer, GeneratorSettings(max_turns=3))
    with pytest.raises(ValueError, match="rewrites history"):
        asyncio.run(generator.generate([Row(PROMPT, ENV)], 1, SamplingParams()))


def test_a_special_token_sampled_inside_a_turn_stays_in_the_trajectory(tokenizer: Any) -> None:
    """The engine's text leaves out a special token the sampler put inside its reply (a random
    model does this), so the conversation's message lacks it; the trajectory keeps the sampled ids
    and the template's rest of the turn follows them (the text is the template's)."""
    inner = next(
        t for t in tokenizer.all_special_ids if t not in (tokenizer.eos_token_id, tokenizer.bos_token_id)
    )
    eos = tokenizer.eos_token_id
    first = _encode(tokenizer, "I think") + [inner] + _encode(tokenizer, " it is 35.") + [eos]
    replies = [Reply(first, matched_stop=eos), *_replies(tokenizer)[1:]]
    trajectory, engine = _rollout(tokenizer, replies)
    sampled = [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m]
    assert sampled[: len(first)] == first  # exactly the sampled ids, the inner special token too
    assert trajectory.num_turns == 3
    # turn 2 continues the trajectory's ids: turn 1's sampled ids, then the template's tokens
    assert engine.prompts[1][: len(engine.prompts[0]) + len(first)] == engine.prompts[0] + first


def test_a_special_token_inside_another_tokenisation_of_the_text_is_followed_as_text(tokenizer: Any) -> None:
    """A random policy's turn: a special token inside, and the rest split into tokens the
    tokenizer would not choose (each character on its own); the text without special tokens is
    the message's, so the rollout goes on with the template's tokens after the sampled ones."""
    inner = next(
        t for t in tokenizer.all_special_ids if t not in (tokenizer.eos_token_id, tokenizer.bos_token_id)
    )
    eos = tokenizer.eos_token_id
    split = [t for ch in " it is 35." for t in _encode(tokenizer, ch)]
    first = _encode(tokenizer, "I think") + [inner] + split + [eos]
    replies = [Reply(first, matched_stop=eos), *_replies(tokenizer)[1:]]
    trajectory, engine = _rollout(tokenizer, replies)
    assert trajectory.num_turns == 3
    assert engine.prompts[1][: len(engine.prompts[0]) + len(first)] == engine.prompts[0] + first
    # nothing of the turn's end twice: the sampled EOS, then the rest of the template's turn end
    after = engine.prompts[1][len(engine.prompts[0]) + len(first) :]
    assert tokenizer.decode(after).count(tokenizer.eos_token) <= 1


def test_a_turn_that_ends_inside_a_character_goes_on(tokenizer: Any) -> None:
    """A random policy's turn whose bytes stop inside a UTF-8 character (its text decodes with a
    replacement character): the rendering is compared as whole texts, so the rollout goes on and
    the template's turn end follows the sampled ids once."""
    eos = tokenizer.eos_token_id
    lead_byte = tokenizer.convert_tokens_to_ids("Ã")  # byte 0xC3 alone: half of a character
    first = _encode(tokenizer, "I think 3") + [lead_byte] + [eos]
    replies = [Reply(first, matched_stop=eos), *_replies(tokenizer)[1:]]
    trajectory, engine = _rollout(tokenizer, replies)
    assert trajectory.num_turns == 3
    assert engine.prompts[1][: len(engine.prompts[0]) + len(first)] == engine.prompts[0] + first
    after = tokenizer.decode(engine.prompts[1][len(engine.prompts[0]) + len(first) :])
    assert "�" not in after and after.count(tokenizer.eos_token) <= 1


def test_random_turns_of_a_random_policy_are_followed_by_the_templates_turn_end() -> None:
    """What a random policy samples (stray bytes, special tokens inside, sometimes EOS): the ids
    after each turn are exactly the template's turn end, observation and next header."""
    import random

    tokenizer = chatml_tokenizer()
    chat = ChatFormat(tokenizer)
    rng = random.Random(7)
    eos = tokenizer.eos_token_id
    prompt = [{"role": "user", "content": "What is 2+2?"}]
    feedback = {"role": "user", "content": "Incorrect, try again."}
    after = chat.render(
        [*prompt, {"role": "assistant", "content": "x"}, feedback], add_generation_prompt=True
    )
    full = tokenizer.decode(after)
    expected = full[full.rindex("x" + tokenizer.eos_token) + 1 :]  # "<|im_end|>\n<|im_start|>user\n..."
    for _ in range(400):
        sampled = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 16))]
        if rng.random() < 0.5:
            sampled.append(eos)
        text = tokenizer.decode(sampled, skip_special_tokens=True)
        conversation = [*prompt, {"role": "assistant", "content": text}, feedback]
        rest = chat.extension(
            chat.prompt_ids(prompt) + sampled, chat.render(conversation, add_generation_prompt=True)
        )
        got = tokenizer.decode(rest)
        assert got == (expected[len(tokenizer.eos_token) :] if sampled[-1] == eos else expected), (
            sampled,
            got,
        )
