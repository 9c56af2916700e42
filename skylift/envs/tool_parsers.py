"""Tool-call parsers: the policy's response text -> the calls it asked for, and what was malformed.

Formats (``tool_parser`` of a `skylift.envs.tools.ToolEnvironment`):

- ``hermes`` (Qwen2/2.5/3, Hermes, SmolLM3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number per response;
- ``llama3_json`` (Llama 3.1-3.3 custom tools): the response is one JSON object
  ``{"name": ..., "parameters": {...}}`` (optionally after ``<|python_tag|>``), or several separated
  by ``;``;
- ``xml`` (any model without a tool template, e.g. taught by the prompt):
  ``<tool name="calc">{"expression": "2+2"}</tool>``; an empty body means no arguments.

A call that cannot be read (bad JSON, no name, arguments not an object, an unclosed tag) is
reported in `ParsedCalls.errors` for the environment to answer with an error message; the parsers
never raise on model output.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class ToolCall:
    """One call the policy asked for."""

    name: str
    arguments: dict[str, Any]


@dataclass
class ParsedCalls:
    """What a parser found: well-formed `calls` and one message per malformed call in `errors`."""

    calls: list[ToolCall] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        """The response asked for a tool at all (well-formed or not)."""
        return bool(self.calls or self.errors)


ToolParser = Callable[[str], ParsedCalls]

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_XML = re.compile(r"<tool\s+name\s*=\s*\"([^\"]*)\"\s*>(.*?)</tool>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


def _call_from_object(obj: Any, arguments_key: str) -> ToolCall | str:
    """A `ToolCall` from a decoded JSON object, or the reason it is not one."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object, got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return 'a tool call needs a "name" string'
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models send the arguments as a JSON string
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return f"the arguments of {name!r} are not valid JSON: {args[:100]!r}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments of {name!r} must be a JSON object, got {type(args).__name__}"
    return ToolCall(name=name, arguments=args)


def _add(parsed: ParsedCalls, outcome: ToolCall | str) -> None:
    if isinstance(outcome, ToolCall):
        parsed.calls.append(outcome)
    else:
        parsed.errors.append(outcome)


def _json_body(body: str, arguments_key: str) -> ToolCall | str:
    try:
        obj = json.loads(body)
    except ValueError as exc:
        return f"invalid JSON in tool call ({exc.msg} at char {exc.pos}): {body.strip()[:100]!r}"
    return _call_from_object(obj, arguments_key)


def parse_hermes(text: str) -> ParsedCalls:
    """``<tool_call>{json}</tool_call>`` blocks; an opening tag without its closing one is an error."""
    parsed = ParsedCalls()
    for match in _HERMES.finditer(text):
        _add(parsed, _json_body(match.group(1), "arguments"))
    rest = _HERMES.sub("", text)
    if "<tool_call>" in rest:
        parsed.errors.append("unclosed <tool_call> (no </tool_call>)")
    return parsed


def parse_llama3_json(text: str) -> ParsedCalls:
    """Llama 3 JSON calls: the whole response is ``{...}`` (or ``{...}; {...}``), ``parameters``
    holding the arguments. A response that does not start with ``{`` is no call."""
    parsed = ParsedCalls()
    body = text.strip()
    if body.startswith(_PYTHON_TAG):
        body = body[len(_PYTHON_TAG) :].strip()
    if not body.startswith("{"):
        return parsed
    decoder = json.JSONDecoder()
    position = 0
    while position < len(body):
        try:
            obj, end = decoder.raw_decode(body, position)
        except ValueError as exc:
            parsed.errors.append(
                f"invalid JSON in tool call ({exc.msg} at char {exc.pos}): {body[position:][:100]!r}"
            )
            return parsed
        _add(parsed, _call_from_object(obj, "parameters"))
        position = end
        while position < len(body) and body[position] in " \t\r\n;":
            position += 1
        if position < len(body) and body[position] != "{":
            parsed.errors.append(f"text after a JSON tool call: {body[position:][:100]!r}")
            return parsed
    return parsed


def parse_xml(text: str) -> ParsedCalls:
    """``<tool name="NAME">{json arguments}</tool>`` tags; an unclosed ``<tool`` is an error."""
    parsed = ParsedCalls()
    for match in _XML.finditer(text):
        name, body = match.group(1).strip(), match.group(2).strip()
        if not name:
            parsed.errors.append('a <tool> tag needs a non-empty name="..."')
            continue
        if not body:
            parsed.calls.append(ToolCall(name=name, arguments={}))
            continue
        _add(parsed, _call_from_object({"name": name, "arguments": body}, "arguments"))
    rest = _XML.sub("", text)
    if re.search(r"<tool[\s>]", rest):
        parsed.errors.append('malformed <tool> tag (expected <tool name="NAME">{...}</tool>)')
    return parsed


TOOL_PARSERS: dict[str, ToolParser] = {
    "hermes": parse_hermes,
    "llama3_json": parse_llama3_json,
    "xml": parse_xml,
}


def get_tool_parser(name: str) -> ToolParser:
    """The parser registered as `name`; ValueError naming the known ones otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}") from None
