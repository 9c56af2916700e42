"""Token ids of a conversation as the tokenizer's chat template renders it, turn by turn.

Multi-turn rollouts are token-in/token-out: the ids the policy sampled are kept as they are (never
decoded and re-rendered), and only what the template puts around them is added, so that the
trajectory's ids equal ``apply_chat_template`` of the final conversation:

- `ChatFormat.close_turn`: after an assistant turn, the template's turn-closing tokens the model
  did not sample (ChatML's "\\n" after ``<|im_end|>``; the whole ``<|im_end|>\\n`` after a stop
  string or a truncated turn);
- `ChatFormat.observation_ids`: the environment's messages and the next assistant header, as the
  template renders them after an assistant message (the rendering of a fixed conversation plus the
  observations, minus that of the conversation).

Both are read off the template by rendering probe conversations, so any template that renders a
conversation as the concatenation of its messages works (ChatML, Llama 3, SmolLM2, Gemma).
"""

from __future__ import annotations

import json
from typing import Any

Messages = list[dict[str, Any]]

_PROBE = "Probe"  # assistant content of the probe conversations (no spaces: templates may trim)
_SYSTEM = {"role": "system", "content": "System"}
_USER = {"role": "user", "content": "User"}
_ASSISTANT = {"role": "assistant", "content": _PROBE}


class ChatTemplateError(ValueError):
    """The chat template does not render a conversation as the concatenation of its turns."""


class ChatFormat:
    """Renders conversations with `tokenizer`'s chat template and `template_kwargs` (e.g.
    ``{"enable_thinking": False}``), and reads the tokens around turns off it."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self._base: dict[str, Messages] = {}
        self._close: dict[str, list[int]] = {}

    # ------------------------------------------------------------------ rendering
    def render(self, messages: Messages, *, add_generation_prompt: bool, tools: Any = None) -> list[int]:
        """Token ids of `messages` rendered by the template (a plain list of ints)."""
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            tokenize=True,
            return_dict=False,
            **self.template_kwargs,
        )
        if hasattr(ids, "keys"):  # some versions return a BatchEncoding regardless
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]

    def render_text(self, messages: Messages, *, add_generation_prompt: bool, tools: Any = None) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                tokenize=False,
                **self.template_kwargs,
            )
        )

    def prompt_ids(self, messages: Messages, tools: Any = None) -> list[int]:
        """The prompt: `messages` and the assistant header the policy continues."""
        return self.render(messages, add_generation_prompt=True, tools=tools)

    # ------------------------------------------------------------------ turn boundaries
    def _base_conversation(self, tools: Any) -> Messages:
        """A probe conversation ending with an assistant turn (with a system message unless the
        template refuses one)."""
        key = _key(tools)
        if key not in self._base:
            try:
                self.render([_SYSTEM, _USER, _ASSISTANT], add_generation_prompt=False, tools=tools)
                self._base[key] = [_SYSTEM, _USER, _ASSISTANT]
            except Exception:  # e.g. Gemma's template raises on a system message
                self._base[key] = [_USER, _ASSISTANT]
        return self._base[key]

    def turn_close_ids(self, tools: Any = None) -> list[int]:
        """The tokens the template puts after an assistant message's content (ChatML:
        ``<|im_end|>\\n``; Llama 3: ``<|eot_id|>``)."""
        key = _key(tools)
        if key not in self._close:
            base = self._base_conversation(tools)
            full = self.render_text(base, add_generation_prompt=False, tools=tools)
            at = full.rfind(_PROBE)
            if at < 0:
                raise ChatTemplateError("the chat template does not render the assistant's message content")
            tail = full[at + len(_PROBE) :]
            close = [int(t) for t in self.tokenizer.encode(tail, add_special_tokens=False)]
            ids = self.render(base, add_generation_prompt=False, tools=tools)
            if close and ids[-len(close) :] != close:
                raise ChatTemplateError(f"the turn-closing text {tail!r} tokenises differently in context")
            self._close[key] = close
        return self._close[key]

    def close_turn(self, sampled: list[int], *, close_unfinished: bool, tools: Any = None) -> list[int]:
        """The turn-closing tokens to add after the sampled ids `sampled` of an assistant turn.

        When `sampled` ends with the start of the closing tokens (the model sampled ``<|im_end|>``),
        the rest of them; otherwise (a stop string or a truncated turn) all of them when
        `close_unfinished`, else none.
        """
        close = self.turn_close_ids(tools)
        for k in range(min(len(close), len(sampled)), 0, -1):
            if sampled[-k:] == close[:k]:
                return close[k:]
        return list(close) if close_unfinished else []

    def observation_ids(self, observations: Messages, tools: Any = None) -> list[int]:
        """`observations` as the template renders them after a closed assistant turn, followed by
        the next assistant header."""
        base = self._base_conversation(tools)
        before = self.render(base, add_generation_prompt=False, tools=tools)
        after = self.render(base + list(observations), add_generation_prompt=True, tools=tools)
        if after[: len(before)] == before:
            return after[len(before) :]
        # the token boundary moved (a merge across the turn end): fall back to the text
        before_text = self.render_text(base, add_generation_prompt=False, tools=tools)
        after_text = self.render_text(base + list(observations), add_generation_prompt=True, tools=tools)
        if not after_text.startswith(before_text):
            raise ChatTemplateError(
                "the chat template renders earlier turns differently once observations follow "
                "(it rewrites history); use generator.use_conversation_multi_turn=false"
            )
        return [
            int(t) for t in self.tokenizer.encode(after_text[len(before_text) :], add_special_tokens=False)
        ]


def _key(tools: Any) -> str:
    return json.dumps(tools, sort_keys=True, default=repr)
