"""Token ids of a conversation as the tokenizer's chat template renders it, turn by turn.

Multi-turn rollouts are token-in/token-out: the ids the policy sampled are kept as they are (never
decoded and re-rendered), and only what the template puts around them is added, so that the
trajectory's ids equal ``apply_chat_template`` of its conversation. What is added is read off the
conversation at hand, never off a probe conversation (`ConversationIds`): after each turn the whole
conversation (the turn's text and the environment's observations appended) is rendered with the
next assistant header, and the rendering must extend the trajectory's ids so far; the ids past them
(the template's rest of the turn, e.g. ChatML's ``<|im_end|>\\n``, the observations and the next
header) follow the turn, untrained. This holds whatever the template does at the end of a
conversation (Phi-3 appends EOS only without a generation prompt) and wherever it puts the system
prompt, as long as it renders earlier turns the same once later ones follow.

A template that renders the conversation so far differently once a turn and observations follow
(it rewrites history: Mistral v0.3 moves the system prompt into the last user turn, DeepSeek-R1 and
Qwen3 drop the thinking of past assistant turns, Llama 3 and Gemma trim whitespace the model
sampled) raises `TemplateMismatch` naming the first token where the two differ: one trajectory
cannot hold it (``generator.on_template_mismatch`` decides: stop, or go on step-wise). Where the
ids differ but decode to the same text (the sampler chose another tokenisation of its own text, or
sampled a special token inside it, which the engine's text and so the message leave out), the
rendering is followed as text: the trajectory equals the template's as text, not as ids.

`ChatFormat.turn_close_ids` and `ChatFormat.observation_ids` give the same pieces for a template
in general (rendered with a probe conversation and checked to carry none of it); the rollout loop
does not use them.
"""

from __future__ import annotations

import re
from typing import Any

from jinja2 import TemplateError

Messages = list[dict[str, Any]]

#: runs of U+FFFD, the mark of bytes that are no character
_REPLACEMENTS = re.compile("\ufffd+")
_PROBE_USER = "Probe-question"  # content of the probe conversations (no spaces: templates may trim)
_PROBE_ANSWER = "Probe-answer"


class ChatTemplateError(ValueError):
    """The chat template does not render a conversation as the concatenation of its turns."""


class TemplateMismatch(ChatTemplateError):
    """The template's rendering of a rollout's conversation does not extend the rollout's ids."""

    def __init__(self, message: str, at: int) -> None:
        super().__init__(message)
        self.at = at  # index (into prompt + response ids) of the first token that differs


class ChatFormat:
    """Renders conversations with `tokenizer`'s chat template and `template_kwargs` (e.g.
    ``{"enable_thinking": False}``), and reads the tokens around turns off it."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})

    # ------------------------------------------------------------------ rendering
    def render(self, messages: Messages, *, add_generation_prompt: bool, tools: Any = None) -> list[int]:
        """Token ids of `messages` rendered by the template (a plain list of ints);
        `ChatTemplateError` when the template cannot render them (see `_applied`)."""
        ids = self._applied(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True)
        if hasattr(ids, "keys"):  # some versions return a BatchEncoding regardless
            ids = ids["input_ids"]
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]

    def render_text(self, messages: Messages, *, add_generation_prompt: bool, tools: Any = None) -> str:
        return str(
            self._applied(messages, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=False)
        )

    def _applied(self, messages: Messages, **kwargs: Any) -> Any:
        """`apply_chat_template`; what the template raises on these messages (its
        ``raise_exception``, a role it does not know, a field it lacks) is a `ChatTemplateError`
        saying so on one line."""
        extra = {"return_dict": False} if kwargs["tokenize"] else {}
        try:
            return self.tokenizer.apply_chat_template(messages, **kwargs, **extra, **self.template_kwargs)
        except (TemplateError, TypeError, KeyError, ValueError, IndexError, AttributeError) as exc:
            if isinstance(exc, ChatTemplateError):
                raise
            roles = [m.get("role") if isinstance(m, dict) else type(m).__name__ for m in messages]
            raise ChatTemplateError(
                f"the chat template cannot render the messages (roles {roles}): {type(exc).__name__}: {exc}"
            ) from exc

    def prompt_ids(self, messages: Messages, tools: Any = None) -> list[int]:
        """The prompt: `messages` and the assistant header the policy continues."""
        return self.render(messages, add_generation_prompt=True, tools=tools)

    def decode(self, ids: list[int]) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=False))

    # ------------------------------------------------------------------ the conversation at hand
    def extension(self, done: list[int], rendered: list[int]) -> list[int]:
        """The ids of `rendered` (a conversation's rendering) after the trajectory ids `done`,
        which it must extend: as ids, else as text (the tokens after the first difference decode
        to the same text); `TemplateMismatch` otherwise."""
        j = 0
        limit = min(len(done), len(rendered))
        while j < limit and done[j] == rendered[j]:
            j += 1
        if j == len(done):
            return rendered[j:]
        # the same text as it decodes; else the same ids but for special tokens the sampler put
        # inside its text (the engine's text skips them, so the conversation's message lacks them)
        # (both, with another tokenisation: the same text once special tokens are left out)
        rest = self._after_text(rendered, j, done, skip_special=False)
        if rest is None:
            rest = self._after_sampled_specials(done, rendered, j)
        if rest is None:
            rest = self._after_text(rendered, j, done, skip_special=True)
        if rest is None:
            raise TemplateMismatch(self._mismatch(done, rendered, j), j)
        return rest

    def _after_text(
        self, rendered: list[int], j: int, done: list[int], skip_special: bool
    ) -> list[int] | None:
        """`rendered` after the fewest of its tokens (past `j`) that decode to what `done` decodes
        to, whole sequences compared (a suffix that starts inside a character's bytes would decode
        differently) and each run of replacement characters counted as one (bytes that decode to no
        character decode to as many marks as the tokens around them group them into); special tokens left out of both with `skip_special`, and then the special
        tokens that end `done` are skipped where `rendered` has them next. None when no prefix does."""

        def text(ids: list[int]) -> str:  # a run of bytes that decode to no character: one mark
            return _REPLACEMENTS.sub(
                "\ufffd", str(self.tokenizer.decode(ids, skip_special_tokens=skip_special))
            )

        whole = text(done)
        lo, hi = j, len(rendered)  # the fewest tokens of `rendered` that decode as long
        while lo < hi:
            mid = (lo + hi) // 2
            if len(text(rendered[:mid])) >= len(whole):
                hi = mid
            else:
                lo = mid + 1
        if text(rendered[:lo]) != whole:
            return None
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        while lo < len(rendered) and rendered[lo] not in special and text(rendered[: lo + 1]) == whole:
            lo += 1  # the rest of a character's bytes (the same text): still the message's
        if skip_special:  # the turn's own closing special tokens, sampled: not again
            end = len(done)
            while end > j and done[end - 1] in special:
                end -= 1
            for token in done[end:]:  # those the template renders too come next there
                if lo < len(rendered) and rendered[lo] == token:
                    lo += 1
        return rendered[lo:]

    def _after_sampled_specials(self, done: list[int], rendered: list[int], j: int) -> list[int] | None:
        """`rendered` after `done`, aligned from `j` with the special tokens of `done` that
        `rendered` does not have skipped; None when anything else differs."""
        special = set(getattr(self.tokenizer, "all_special_ids", []) or [])
        i = k = j
        while i < len(done):
            if k < len(rendered) and done[i] == rendered[k]:
                i, k = i + 1, k + 1
            elif done[i] in special:
                i += 1
            else:
                return None
        return rendered[k:]

    def _mismatch(self, done: list[int], rendered: list[int], at: int) -> str:
        before = self.decode(done[max(0, at - 6) : at])
        ours = self.decode(done[at : at + 8])
        theirs = self.decode(rendered[at : at + 8])
        return (
            "the chat template renders the conversation so far differently once the turn and the "
            f"observations follow (it rewrites history): after {before!r} (token {at} of {len(done)}) "
            f"the trajectory has {ours!r} where the template now renders {theirs!r}; one trajectory "
            "cannot hold both: set generator.on_template_mismatch=step_wise (this rollout goes on "
            "step-wise) or generator.step_wise_trajectories=true"
        )

    # ------------------------------------------------------------------ probes (not used by rollouts)
    def turn_close_ids(self, tools: Any = None) -> list[int]:
        """The tokens the template puts after an assistant message's content when the
        conversation goes on (ChatML: ``<|im_end|>\\n``; Llama 3: ``<|eot_id|>``; Phi-3:
        ``<|end|>\\n``, without the EOS it ends a whole conversation with)."""
        done, closed = self._probe_answer(tools)
        closed = closed[len(done) :]
        user = {"role": "user", "content": _PROBE_USER}
        answer = {"role": "assistant", "content": _PROBE_ANSWER}
        going_on = self.extension(
            done, self.render([user, answer, user], add_generation_prompt=True, tools=tools)
        )
        k = 0
        while k < min(len(closed), len(going_on)) and closed[k] == going_on[k]:
            k += 1
        return self._clean(closed[:k])

    def observation_ids(self, observations: Messages, tools: Any = None) -> list[int]:
        """`observations` as the template renders them after a closed assistant turn, followed by
        the next assistant header; `ChatTemplateError` when that rendering carries anything of the
        probe conversation it is read off (a template that moves earlier messages)."""
        user = {"role": "user", "content": _PROBE_USER}
        answer = {"role": "assistant", "content": _PROBE_ANSWER}
        done = self._probe_answer(tools)[0] + self.turn_close_ids(tools)
        rendered = self.render([user, answer, *observations], add_generation_prompt=True, tools=tools)
        return self._clean(self.extension(done, rendered))

    def _probe_answer(self, tools: Any) -> tuple[list[int], list[int]]:
        """A probe conversation's ids up to the end of its answer's content, and all its ids."""
        user = {"role": "user", "content": _PROBE_USER}
        answer = {"role": "assistant", "content": _PROBE_ANSWER}
        base = self.render([user], add_generation_prompt=True, tools=tools)
        closed = self.render([user, answer], add_generation_prompt=False, tools=tools)
        if closed[: len(base)] != base:
            raise ChatTemplateError("the chat template renders a prompt differently once its answer follows")
        for k in range(len(base), len(closed) + 1):
            if _PROBE_ANSWER in self.decode(closed[len(base) : k]):
                return closed[:k], closed
        raise ChatTemplateError("the chat template does not render the assistant's message content")

    def _clean(self, ids: list[int]) -> list[int]:
        text = self.decode(ids)
        if _PROBE_USER in text or _PROBE_ANSWER in text:
            raise ChatTemplateError(f"the chat template moves earlier messages into later turns: {text!r}")
        return ids


class ConversationIds:
    """One rollout's conversation and the ids the template gives it so far (the trajectory's ids,
    plus any turn-closing ids it leaves out with ``append_eos_after_stop_str=false``)."""

    def __init__(self, chat: ChatFormat, messages: Messages, tools: Any) -> None:
        self.chat = chat
        self.tools = tools
        self.messages = [dict(m) for m in messages]
        self.ids = chat.prompt_ids(self.messages, tools)

    def after_turn(
        self, sampled: list[int], text: str, observations: Messages, *, drop_close: bool
    ) -> list[int]:
        """The untrained ids that follow the turn's `sampled` ids (its text `text`) and the
        environment's `observations`: the template's rest of the turn (left out with
        `drop_close`), the observations and the next assistant header. `TemplateMismatch` when
        the template renders the conversation differently than the trajectory holds it."""
        done = self.ids + [int(t) for t in sampled]
        answered = [*self.messages, {"role": "assistant", "content": text}]
        going_on = answered + [dict(m) for m in observations]
        rest = self.chat.extension(
            done, self.chat.render(going_on, add_generation_prompt=True, tools=self.tools)
        )
        self.messages, self.ids = going_on, done + rest
        if not drop_close:
            return rest
        closed = self.chat.render(answered, add_generation_prompt=False, tools=self.tools)
        closed = closed[len(done) :] if closed[: len(done)] == done else []
        k = 0
        while k < min(len(closed), len(rest)) and closed[k] == rest[k]:
            k += 1
        return rest[k:]
