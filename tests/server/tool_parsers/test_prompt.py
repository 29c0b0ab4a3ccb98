"""The hermes-style tools block for templates that do not render tools."""

from __future__ import annotations

import json

from aserve.server.tool_parsers import (
    HermesToolParser,
    hermes_tool_calls_text,
    render_hermes_tools_prompt,
    with_tools_system_prompt,
)

TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Météo", "parameters": {"type": "object"}},
    },
    {"type": "function", "function": {"name": "now"}},
]


def test_block_lists_each_tool_as_json_and_shows_the_call_format():
    block = render_hermes_tools_prompt(TOOLS)
    inside = block.split("<tools>\n", 1)[1].split("\n</tools>", 1)[0]
    assert [json.loads(line) for line in inside.splitlines()] == TOOLS
    assert "Météo" in block  # not escaped
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in block
    assert render_hermes_tools_prompt([]) == ""


def test_block_joins_an_existing_system_message_or_becomes_one():
    block = render_hermes_tools_prompt(TOOLS)
    user = {"role": "user", "content": "hi"}
    conversation = [{"role": "system", "content": "Be brief."}, user]
    merged = with_tools_system_prompt(conversation, TOOLS)
    assert merged == [{"role": "system", "content": "Be brief.\n\n" + block}, user]
    assert conversation[0]["content"] == "Be brief."  # the input is not modified
    assert with_tools_system_prompt([user], TOOLS) == [{"role": "system", "content": block}, user]
    assert with_tools_system_prompt([user], []) == [user]


def test_history_calls_render_in_the_format_the_parser_reads():
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
        },
        {"id": "call_2", "type": "function", "function": {"name": "now", "arguments": ""}},
    ]
    text = hermes_tool_calls_text(calls)
    content, parsed = HermesToolParser().extract(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
        ("get_weather", {"city": "Oslo"}),
        ("now", {}),
    ]
