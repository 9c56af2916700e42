"""Tool-call parsers: Hermes/Qwen ``<tool_call>``, Llama 3 JSON and the plain XML tag, with the
malformed calls a policy writes (bad JSON, no name, unclosed tags) reported, never raised."""

from __future__ import annotations

import pytest

from skylift.envs.tool_parsers import (
    TOOL_PARSERS,
    ToolCall,
    get_tool_parser,
    parse_hermes,
    parse_llama3_json,
    parse_xml,
)


def test_hermes_reads_every_call_and_string_arguments() -> None:
    text = (
        'Let me compute.\n<tool_call>\n{"name": "calc", "arguments": {"expression": "12*34"}}\n</tool_call>\n'
        '<tool_call>{"name": "clock", "arguments": "{}"}</tool_call>'
    )
    parsed = parse_hermes(text)
    assert parsed.calls == [ToolCall("calc", {"expression": "12*34"}), ToolCall("clock", {})]
    assert parsed.errors == []


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool_call>{"name": "calc", "arguments": {"expression": 1</tool_call>', "invalid JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', '"name"'),
        ('<tool_call>{"name": "calc", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
        ('<tool_call>["calc"]</tool_call>', "must be a JSON object"),
        ('<tool_call>{"name": "calc", "arguments": "not json"}</tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "calc", "arguments": {}}', "unclosed <tool_call>"),
    ],
)
def test_hermes_reports_malformed_calls(text: str, error: str) -> None:
    parsed = parse_hermes(text)
    assert parsed.calls == [] and parsed.found
    assert len(parsed.errors) == 1 and error in parsed.errors[0]


def test_hermes_keeps_good_calls_beside_a_bad_one() -> None:
    parsed = parse_hermes(
        '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{oops}</tool_call>'
    )
    assert parsed.calls == [ToolCall("a", {})] and len(parsed.errors) == 1


def test_llama3_json_reads_parameters_and_several_calls() -> None:
    parsed = parse_llama3_json('{"name": "calc", "parameters": {"expression": "2+2"}}')
    assert parsed.calls == [ToolCall("calc", {"expression": "2+2"})]
    parsed = parse_llama3_json(
        '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "parameters": {"x": 1}}'
    )
    assert parsed.calls == [ToolCall("a", {}), ToolCall("b", {"x": 1})] and not parsed.errors


def test_llama3_json_plain_text_is_no_call_and_bad_json_is_an_error() -> None:
    assert not parse_llama3_json("The answer is 4.").found
    bad = parse_llama3_json('{"name": "calc", "parameters": {"expression": }')
    assert bad.calls == [] and "invalid JSON" in bad.errors[0]
    trailing = parse_llama3_json('{"name": "calc", "parameters": {}} and then some words')
    assert trailing.calls == [ToolCall("calc", {})] and "text after" in trailing.errors[0]
    nameless = parse_llama3_json('{"parameters": {}}')
    assert '"name"' in nameless.errors[0]


def test_xml_reads_named_tags_with_json_or_empty_bodies() -> None:
    parsed = parse_xml(
        'I will use it. <tool name="calc">{"expression": "7*8"}</tool> and <tool name="clock"></tool>'
    )
    assert parsed.calls == [ToolCall("calc", {"expression": "7*8"}), ToolCall("clock", {})]
    assert not parse_xml("no tools here").found


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('<tool name="calc">{"expression": 7*8}</tool>', "not valid JSON"),
        ('<tool name="">{}</tool>', "non-empty name"),
        ('<tool name="calc">{"expression": "1"}', "malformed <tool>"),
        ("<tool>{}</tool>", "malformed <tool>"),
        ('<tool name="calc">[1]</tool>', "must be a JSON object"),
    ],
)
def test_xml_reports_malformed_tags(text: str, error: str) -> None:
    parsed = parse_xml(text)
    assert parsed.calls == [] and parsed.found
    assert any(error in e for e in parsed.errors), parsed.errors


def test_parsers_never_raise_on_garbage() -> None:
    garbage = ["", "<tool_call>", "</tool_call>", "{", "{}}", '<tool name="x">', "\x00\xff", "{" * 50]
    for parser in TOOL_PARSERS.values():
        for text in garbage:
            parser(text)


def test_unknown_parser_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match="hermes, llama3_json, xml"):
        get_tool_parser("mistral")
