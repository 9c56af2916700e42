"""Token ids of a training row and which of them carry the loss.

A conversation is rendered by the tokenizer's chat template (`skylift.generator.chat.ChatFormat`,
the renderer the RL generator uses) and an assistant message's tokens are the ids its rendering
adds after the conversation before it and the template's assistant header: for assistant message
``i``, ``render(messages[:i + 1])`` minus ``render(messages[:i], add_generation_prompt=True)``, up
to what the template ends only a whole conversation with when a later message follows (Phi-3's
EOS). That is what `apply_chat_template(..., return_assistant_tokens_mask=True)` marks for a template
whose ``{% generation %}`` block closes after the turn's end (ChatML: the content, ``<|im_end|>``
and the newline), without needing the template to carry the tags. A template that renders earlier
turns differently once later ones follow (it rewrites history: Qwen3 drops past reasoning) cannot
mark them so and is refused with the row named, unless only the last assistant message is trained.
A plain-text prompt/completion row is tokenized as text: the loss is on the completion and the EOS.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from skylift.data.chat import ChatExample
from skylift.generator.chat import ChatFormat


class TokenizeError(ValueError):
    """A row cannot be tokenized with an assistant mask (the message names the row and why)."""


@dataclass(frozen=True)
class TokenizedRow:
    ids: list[int]
    loss_mask: list[int]  # 1 = the token is a target of the loss

    @property
    def loss_tokens(self) -> int:
        # the first token is never a target (nothing predicts it)
        return sum(self.loss_mask[1:])


def tokenize_example(
    tokenizer: Any,
    example: ChatExample,
    last_only: bool = False,
    max_length: int | None = None,
    template_kwargs: dict[str, Any] | None = None,
    where: str = "row",
) -> TokenizedRow:
    """`example` as ids and loss mask (see the module docstring), cut to `max_length` tokens."""
    if example.messages is None:
        ids, mask = _text_tokens(tokenizer, example.prompt_text or "", example.completion_text or "")
    else:
        chat = ChatFormat(tokenizer, template_kwargs)
        ids, mask = assistant_mask(chat, example.messages, example.tools, last_only, where)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    if len(ids) < 2:
        raise TokenizeError(f"{where}: fewer than 2 tokens after tokenization (nothing to predict)")
    return TokenizedRow(ids, mask)


def assistant_mask(
    chat: ChatFormat, messages: list[dict[str, Any]], tools: Any, last_only: bool, where: str = "row"
) -> tuple[list[int], list[int]]:
    """(ids of the whole conversation, 1 on the tokens of its assistant messages)."""
    full = chat.render(messages, add_generation_prompt=False, tools=tools)
    mask = [0] * len(full)
    turns = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if last_only:
        turns = turns[-1:]
    for i in turns:
        start, end = _turn_span(chat, messages, i, tools)
        content = messages[i].get("content")
        text = chat.decode(full[start:end])
        if full[:end] != chat.render(messages[: i + 1], add_generation_prompt=False, tools=tools)[:end] or (
            isinstance(content, str) and content.strip() not in text
        ):
            raise TokenizeError(
                f"{where}: the chat template renders assistant message {i} differently once later "
                "messages follow (it rewrites history), so its tokens cannot be told apart; train only "
                "the last assistant message (train_on_what=last_assistant_message)"
            )
        mask[start:end] = [1] * (end - start)
    return full, mask


def _turn_span(chat: ChatFormat, messages: list[dict[str, Any]], i: int, tools: Any) -> tuple[int, int]:
    """[start, end) of assistant message `i`'s tokens in the rendering of `messages[: i + 1]`: after
    the header the template puts before it, through the tokens that close the turn when the
    conversation goes on (and, when it is the conversation's last message, what the template ends
    a conversation with: Phi-3's EOS)."""
    before = chat.render(messages[:i], add_generation_prompt=True, tools=tools) if i else []
    through = chat.render(messages[: i + 1], add_generation_prompt=False, tools=tools)
    if through[: len(before)] != before:
        raise TokenizeError(
            f"the chat template renders the conversation before assistant message {i} differently"
        )
    if i == len(messages) - 1:
        return len(before), len(through)
    going_on = chat.render(
        [*messages[: i + 1], {"role": "user", "content": "."}], add_generation_prompt=False, tools=tools
    )
    k = len(before)
    while k < min(len(through), len(going_on)) and through[k] == going_on[k]:
        k += 1
    return len(before), k


def _text_tokens(tokenizer: Any, prompt: str, completion: str) -> tuple[list[int], list[int]]:
    prompt_ids = list(tokenizer(prompt)["input_ids"])
    full = list(tokenizer(prompt + completion)["input_ids"])
    if full[: len(prompt_ids)] != prompt_ids:  # the join tokenizes across the boundary
        full = prompt_ids + list(tokenizer(completion, add_special_tokens=False)["input_ids"])
    eos = tokenizer.eos_token_id
    if eos is not None and (not full or full[-1] != eos):
        full.append(int(eos))
    return full, [0] * len(prompt_ids) + [1] * (len(full) - len(prompt_ids))


__all__ = ["TokenizeError", "TokenizedRow", "assistant_mask", "tokenize_example"]
