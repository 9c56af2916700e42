"""The chat templates in wide use, from their published jinja text (`chat_templates/`), each on a
local tokenizer with the family's special tokens, driven through the `Generator`'s multi-turn path:
3 turns (truncated, ended on a stop string, ended with the family's end-of-turn token) with
feedback or tool results between them. Each family is either exact (the trajectory's ids are
``apply_chat_template`` of its conversation, sampled ids the only trained ones) or refused for its
true reason (`TemplateMismatch`: the template rewrites history), and then exact step-wise."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from agentic_fakes import Reply, Row, ScriptedEngine

from skylift.envs import Environment, StepResult, register_env, unregister_env
from skylift.generator import Generator, GeneratorSettings
from skylift.generator.chat import ChatFormat, TemplateMismatch
from skylift.inference.types import SamplingParams

TEMPLATES = Path(__file__).parent / "chat_templates"
ENV = "template_matrix"
SYSTEM = {"role": "system", "content": "You solve arithmetic."}
QUESTION = {"role": "user", "content": "What is 12 * 3?"}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calc",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expr": {"type": "string"}},
                "required": ["expr"],
            },
        },
    }
]
CHATML = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass
class Family:
    template: str
    eos: str  # the token that ends an assistant turn
    specials: list[str]
    bos: str | None = None
    added: list[str] = field(default_factory=list)  # added, not special (thinking/tool tags)
    system: bool = True
    tool_call: str | None = None  # a tool call as the model writes it (None: no tools)
    think: str = ""  # what the model writes before its answer in a turn (thinking)
    think_from: int = 0  # the first turn (0-based) that thinks
    prefix: str = ""  # what the model writes first (a space, after Mistral's [/INST])
    kwargs: dict[str, Any] = field(default_factory=dict)
    refused: str | None = None  # the reason the template is refused (None: exact)


QWEN_CALL = '<tool_call>\n{"name": "calc", "arguments": {"expr": "12*3"}}\n</tool_call>'
FAMILIES: dict[str, Family] = {
    "qwen2_5": Family(
        "qwen2_5", "<|im_end|>", CHATML, added=["<tool_call>", "</tool_call>"], tool_call=QWEN_CALL
    ),
    # thinking after the last user message is kept (a tool result is not a user query)
    "qwen3": Family(
        "qwen3",
        "<|im_end|>",
        CHATML,
        added=["<think>", "</think>", "<tool_call>", "</tool_call>"],
        tool_call=QWEN_CALL,
        think="<think>\nhm\n</think>\n\n",
        think_from=1,
    ),
    "qwen3_thinking": Family(
        "qwen3",
        "<|im_end|>",
        CHATML,
        added=["<think>", "</think>"],
        think="<think>\nhm\n</think>\n\n",
        refused="trajectory has '<think>",
    ),
    "qwen3_no_thinking": Family(
        "qwen3",
        "<|im_end|>",
        CHATML,
        added=["<think>", "</think>"],
        kwargs={"enable_thinking": False},
        refused="trajectory has '<think>",
    ),
    "llama3_2_tools": Family(
        "llama3_2",
        "<|eot_id|>",
        ["<|endoftext|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>"],
        bos="<|begin_of_text|>",
        tool_call='{"name": "calc", "parameters": {"expr": "12*3"}}',
        kwargs={"date_string": "26 Jul 2024"},
    ),
    "mistral_v3": Family(
        "mistral_v3", "</s>", ["[INST]", "[/INST]", "</s>"], bos="<s>", system=False, prefix=" "
    ),
    "mistral_v3_system": Family(
        "mistral_v3",
        "</s>",
        ["[INST]", "[/INST]", "</s>"],
        bos="<s>",
        prefix=" ",
        refused="trajectory has 'You solve arithmet",
    ),
    "mistral_v7_tekken": Family(
        "mistral_v7_tekken",
        "</s>",
        ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "</s>"],
        bos="<s>",
    ),
    "gemma2": Family(
        "gemma2", "<end_of_turn>", ["<start_of_turn>", "<end_of_turn>", "<eos>"], bos="<bos>", system=False
    ),
    "gemma3": Family("gemma3", "<end_of_turn>", ["<start_of_turn>", "<end_of_turn>", "<eos>"], bos="<bos>"),
    "phi3": Family(
        "phi3", "<|end|>", ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    ),
    "phi3_5": Family(
        "phi3_5", "<|end|>", ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    ),
    "phi4_mini": Family(
        "phi4_mini", "<|end|>", ["<|endoftext|>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
    ),
    "deepseek_v3": Family(
        "deepseek_v3",
        "<｜end▁of▁sentence｜>",
        ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        bos="<｜begin▁of▁sentence｜>",
    ),
    "deepseek_r1": Family(
        "deepseek_r1",
        "<｜end▁of▁sentence｜>",
        ["<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"],
        bos="<｜begin▁of▁sentence｜>",
        added=["<think>", "</think>"],
        think="hm\n</think>\n\n",
        refused="trajectory has '<think>",
    ),
    "granite3": Family(
        "granite3",
        "<|end_of_text|>",
        ["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"],
    ),
    "smollm2": Family("smollm2", "<|im_end|>", CHATML),
}


class ThreeTurns(Environment):
    """Feedback after turn 1; after turn 2 a tool result (with `tools`) or more feedback; done
    after turn 3."""

    def __init__(self, tools: bool = False) -> None:
        super().__init__()
        self.tools = tools

    def tool_schemas(self) -> list[dict[str, Any]] | None:
        return TOOLS if self.tools else None

    def step(self, action: str) -> StepResult:
        turn = self._begin_step()
        if turn == 1:
            return StepResult([{"role": "user", "content": "Not quite. Try again."}], 0.25, False)
        if turn == 2:
            if self.tools:
                return StepResult(
                    [{"role": "tool", "content": "36", "tool_call_id": "call12345"}], 0.5, False
                )
            return StepResult([{"role": "user", "content": "Closer; show the product."}], 0.5, False)
        self.done = True
        return StepResult([], 1.0, True)


@pytest.fixture(autouse=True)
def _env() -> Iterator[None]:
    register_env(ENV)(ThreeTurns)
    yield
    unregister_env(ENV)


@pytest.fixture(scope="module")
def vocabulary() -> str:
    from skylift.models.tiny_qwen2 import train_tokenizer

    return str(train_tokenizer().to_str())


def family_tokenizer(vocabulary: str, family: Family) -> Any:
    """tiny-qwen2's byte-level BPE with the family's special tokens and published template."""
    from tokenizers import AddedToken, Tokenizer
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(vocabulary),
        bos_token=family.bos,
        eos_token=family.eos,
        additional_special_tokens=[t for t in family.specials if t not in (family.eos, family.bos)],
        chat_template=(TEMPLATES / f"{family.template}.jinja").read_text(),
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in family.added])
    return tokenizer


def _encode(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]


def _replies(tokenizer: Any, family: Family) -> list[Reply]:
    """Turn 1 truncated (longer than max_generate_length), turn 2 ended on a stop string (a tool
    call where the template has tools), turn 3 with the end-of-turn token."""
    eos = tokenizer.convert_tokens_to_ids(family.eos)
    long = (
        family.prefix
        + "I think the product of twelve and three is thirty five because ten threes are thirty and two more"
    )
    second = family.tool_call or "Let me recompute: 12 * 3 = 36</answer>"
    think = [family.think if k >= family.think_from else "" for k in range(3)]
    return [
        Reply(_encode(tokenizer, long)),
        Reply(_encode(tokenizer, family.prefix + think[1] + second), matched_stop="</answer>"),
        Reply(_encode(tokenizer, family.prefix + think[2] + "The answer is 36.") + [eos], matched_stop=eos),
    ]


MAX_TOKENS = 24


def _rollout(
    tokenizer: Any, family: Family, **settings: Any
) -> tuple[list[Any], ScriptedEngine, list[Reply]]:
    replies = _replies(tokenizer, family)
    engine = ScriptedEngine(replies)
    kwargs = dict(family.kwargs)
    generator = Generator(
        engine,
        tokenizer,
        GeneratorSettings(
            max_turns=3,
            max_generate_length=MAX_TOKENS,
            max_prompt_length=1024,
            env_kwargs={"tools": family.tool_call is not None},
            chat_template_kwargs=kwargs,
            **settings,
        ),
    )
    prompt = [SYSTEM, QUESTION] if family.system else [QUESTION]
    out = asyncio.run(generator.generate([Row(prompt, ENV)], 1, SamplingParams(max_tokens=64)))
    return out, engine, replies


def _conversation(tokenizer: Any, family: Family, replies: list[Reply]) -> list[list[dict[str, Any]]]:
    """The conversation before each turn, and at the end (built here, not by the generator)."""
    messages: list[dict[str, Any]] = [SYSTEM, QUESTION] if family.system else [QUESTION]
    before = []
    observations = [
        [{"role": "user", "content": "Not quite. Try again."}],
        [{"role": "tool", "content": "36", "tool_call_id": "call12345"}]
        if family.tool_call
        else [{"role": "user", "content": "Closer; show the product."}],
        [],
    ]
    for reply, seen in zip(replies, observations, strict=True):
        before.append(list(messages))
        text = tokenizer.decode(reply.token_ids[:MAX_TOKENS], skip_special_tokens=True)
        messages = [*messages, {"role": "assistant", "content": text}, *seen]
    return [*before, messages]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_the_family_is_exact_or_refused_for_its_reason(vocabulary: str, name: str) -> None:
    family = FAMILIES[name]
    tokenizer = family_tokenizer(vocabulary, family)
    chat = ChatFormat(tokenizer, family.kwargs)
    tools = TOOLS if family.tool_call else None
    if family.refused is not None:
        with pytest.raises(TemplateMismatch, match="rewrites history") as caught:
            _rollout(tokenizer, family)
        assert family.refused in str(caught.value), str(caught.value)
        # switched to step-wise: each step's prompt is the template's rendering of its conversation
        steps, engine, replies = _rollout(tokenizer, family, on_template_mismatch="step_wise")
        conversations = _conversation(tokenizer, family, replies)
        assert len(steps) == 3 and [s.last_step for s in steps] == [False, False, True]
        for k, step in enumerate(steps):
            assert step.prompt_ids == chat.prompt_ids(conversations[k], tools) == engine.prompts[k]
            assert step.response_ids == replies[k].token_ids[:MAX_TOKENS]
            assert step.loss_mask == [1] * len(step.response_ids)
        return
    (trajectory,), engine, replies = _rollout(tokenizer, family)
    conversations = _conversation(tokenizer, family, replies)
    ids = trajectory.prompt_ids + trajectory.response_ids
    rendered = chat.render(conversations[-1], add_generation_prompt=False, tools=tools)
    assert rendered[: len(ids)] == ids
    # what the template adds after the last turn is only its end (e.g. Phi-3's "\n<|endoftext|>")
    assert tokenizer.decode(rendered[len(ids) :], skip_special_tokens=True).strip() == ""
    for k, prompt in enumerate(engine.prompts):
        assert prompt == chat.prompt_ids(conversations[k], tools), f"turn {k + 1}"
    assert trajectory.stop_reason == "stop" and trajectory.num_turns == 3
    trained = [t for t, m in zip(trajectory.response_ids, trajectory.loss_mask, strict=True) if m]
    assert trained == [t for reply in replies for t in reply.token_ids[:MAX_TOKENS]]
    untrained = [lp for lp, m in zip(trajectory.rollout_logprobs, trajectory.loss_mask, strict=True) if not m]
    assert untrained and set(untrained) == {0.0}
    if family.tool_call:
        assert "36" in tokenizer.decode(trajectory.response_ids) and "calc" in tokenizer.decode(ids)


# ---------------------------------------------------------------------- the three failures of issue 42


def test_no_probe_text_reaches_mistral_observations(vocabulary: str) -> None:
    """Mistral v0.3 moves the system prompt into the last user turn: a probe's system message
    must not land in the observations."""
    tokenizer = family_tokenizer(vocabulary, FAMILIES["mistral_v3"])
    ids = ChatFormat(tokenizer).observation_ids([{"role": "user", "content": "Try again."}])
    text = tokenizer.decode(ids)
    assert text == "[INST] Try again.[/INST]" and "System" not in text and "Probe" not in text


def test_phi3_appending_eos_only_at_the_end_is_accepted_and_exact(vocabulary: str) -> None:
    for name in ("phi3", "phi3_5", "phi4_mini"):
        tokenizer = family_tokenizer(vocabulary, FAMILIES[name])
        close = ChatFormat(tokenizer).turn_close_ids()
        assert tokenizer.decode(close) in ("<|end|>\n", "<|end|>"), name  # without <|endoftext|>
    tokenizer = family_tokenizer(vocabulary, FAMILIES["phi3"])
    (trajectory,), _, _ = _rollout(tokenizer, FAMILIES["phi3"])
    assert "<|endoftext|>" not in tokenizer.decode(trajectory.response_ids)


def test_dropped_thinking_is_detected_on_the_conversation_itself(vocabulary: str) -> None:
    """DeepSeek-R1 drops the thinking of past turns; no probe has thinking, so only rendering the
    rollout's own conversation shows it: the rollout stops at turn 1 naming the dropped text."""
    family = FAMILIES["deepseek_r1"]
    tokenizer = family_tokenizer(vocabulary, family)
    with pytest.raises(TemplateMismatch, match="on_template_mismatch=step_wise") as caught:
        _rollout(tokenizer, family)
    prompt_len = len(ChatFormat(tokenizer).prompt_ids([SYSTEM, QUESTION]))
    assert caught.value.at == prompt_len - 2  # the generation prompt's "<think>\n"
