"""The mistral parser on fixed model outputs, whole and streamed split at every character."""

from __future__ import annotations

import json

import pytest

from aserve.server.tool_parsers import MistralToolParser
from tests.server.tool_parsers.tool_replay import assert_split_invariant, replay

ARGS = '{"text": "line1\\nline2 \\u00e9 日本", "opts": {"deep": [{"k": false}]}}'

CASES = [
    ('[TOOL_CALLS][{"name": "translate", "arguments": ' + ARGS + "}]", None, [("translate", ARGS)]),
    (
        '[TOOL_CALLS] [ {"name": "a", "arguments": {"x": 1}} , {"name": "b", "arguments": {}} ]',
        None,
        [("a", '{"x": 1}'), ("b", "{}")],
    ),
    ('Let me check.[TOOL_CALLS][{"name": "a", "arguments": {}}]', "Let me check.", [("a", "{}")]),
    ('Before [TOOL_CALLS][{"name": "a", "arguments": {}}] after', "Before after", [("a", "{}")]),
    ('[TOOL_CALLS]{"name": "a", "arguments": {"y": 2}}', None, [("a", '{"y": 2}')]),
    ('[TOOL_CALLS][{"name": "a", "arguments": {}}', None, [("a", "{}")]),  # the output ended before "]"
    # not calls: content, verbatim
    ("No tools needed.", "No tools needed.", []),
    ("[TOOL_CALLS] sorry", "[TOOL_CALLS] sorry", []),
    ('[TOOL_CALLS][{"nam": "a"}]', '[TOOL_CALLS][{"nam": "a"}]', []),
    ("[TOOL_CALLS][", "[TOOL_CALLS][", []),
    ("[TOOL_CA", "[TOOL_CA", []),
    ("[TOOL_CALLS][]", None, []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_extract_and_every_split_agree(text, content, calls):
    result = assert_split_invariant(MistralToolParser, text)
    assert not result.failed
    assert (result.content, result.calls) == (content, calls)
    for _, arguments in result.calls:
        json.loads(arguments)


def test_ids_are_nine_letters_and_digits():
    text = '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"name": "b", "arguments": {}}]'
    result = replay(MistralToolParser, list(text))
    assert len(result.ids) == 2 and len(set(result.ids)) == 2
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in result.ids)
