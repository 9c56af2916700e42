"""Patch: a client's Responses API input that vLLM's parser crashes on gets a 400, not a 500.

vLLM 0.32 turns each item of a ``/v1/responses`` (and ``/v1/responses/render``) ``input`` into a
chat message in ``_construct_message_from_response_item``. It reads an assistant message's text as
``item.content[0].text``: an assistant message whose content is empty, or starts with a
``refusal`` part (a shape the schema allows), raises IndexError or AttributeError, which vLLM
answers with a 500 that names nothing. `install` wraps that function so that such an error from
one item becomes vLLM's own validation error (a 400 naming ``input`` and the item), while every
item it could parse is built as before.

It also mends one shape the schema allows: a ``function_call_output`` item with an ``id`` and a
``status`` whose ``output`` is a list of content parts is parsed into pydantic objects, and vLLM's
chat parser asserts that each part is a dict (an AssertionError, again a 500 with no message).
The parts are handed on as the dicts they came from.

Upstream: vllm-project/vllm#49130 (open: empty or refusal content of a replayed assistant turn);
the list-of-parts assertion has no issue filed. Removable when vLLM's
``_construct_message_from_response_item`` reads ``item.content`` guarded and passes dict parts
(the Responses rows of tests/reliability/test_hostile_input.py then pass without it).
"""

from __future__ import annotations

import functools
from typing import Any

from skylift.inference.vllm_patches.versions import guard, missing_target

NAME = "responses_input"
WRITTEN_FOR = "==0.32.*"


def install() -> None:
    """Patch vLLM's Responses input parser (idempotent); `VllmPatchVersionError` on a vLLM it does
    not fit."""
    guard(NAME, WRITTEN_FOR)
    try:
        from vllm.entrypoints.openai.responses import utils
        from vllm.exceptions import VLLMValidationError
    except ImportError as exc:
        raise missing_target(NAME, f"Responses input parser ({exc})") from exc
    original = getattr(utils, "_construct_message_from_response_item", None)
    if original is None:
        raise missing_target(
            NAME, "vllm.entrypoints.openai.responses.utils._construct_message_from_response_item"
        )
    if getattr(original, "_skylift_checked", False):
        return

    @functools.wraps(original)
    def construct(item: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            message = original(item, *args, **kwargs)
        except (AttributeError, IndexError, KeyError, TypeError) as exc:
            kind = item.get("type") if isinstance(item, dict) else getattr(item, "type", type(item).__name__)
            raise VLLMValidationError(
                f"input item of type {kind!r} cannot be read ({type(exc).__name__}: {exc}); an "
                "assistant message needs a first content part of type output_text",
                parameter="input",
            ) from exc
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, list):
            message["content"] = [_as_dict(part) for part in content]
        return message

    construct._skylift_checked = True  # type: ignore[attr-defined]
    utils._construct_message_from_response_item = construct


def _as_dict(part: Any) -> Any:
    """A content part as vLLM's chat parser takes it: a dict (pydantic objects dumped)."""
    dump = getattr(part, "model_dump", None)
    return dump(exclude_none=True) if callable(dump) else part
