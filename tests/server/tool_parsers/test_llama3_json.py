"""The llama3_json parser on fixed model outputs, whole and streamed split at every character."""

from __future__ import annotations

import json

import pytest

from aserve.server.tool_parsers import Llama3JsonToolParser
from tests.server.tool_parsers.tool_replay import assert_split_invariant

ARGS = '{"query": "naïve \\"quotes\\" ☃", "filters": {"year": [2023, 2024], "deep": {"x": null}}}'

CASES = [
    ('{"name": "search", "parameters": ' + ARGS + "}", None, [("search", ARGS)]),
    ('<|python_tag|>{"name": "search", "parameters": ' + ARGS + "}", None, [("search", ARGS)]),
    ('\n {"name": "a", "parameters": {"x": 1}}', None, [("a", '{"x": 1}')]),
    (
        '{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}};{"name": "c", "arguments": {"y": 2}}',
        None,
        [("a", '{"x": 1}'), ("b", "{}"), ("c", '{"y": 2}')],
    ),
    ('{"parameters": {"x": 1}, "name": "late_name"}', None, [("late_name", '{"x": 1}')]),
    ('{"name": "a", "parameters": {}}\n\nDone.', "Done.", [("a", "{}")]),
    ('{"name": "a", "parameters": {}};', None, [("a", "{}")]),
    # not calls: content, verbatim
    ("The answer is 42.", "The answer is 42.", []),
    ('Here you go: {"name": "a", "parameters": {}}', 'Here you go: {"name": "a", "parameters": {}}', []),
    ('{"answer": 42}', '{"answer": 42}', []),
    ('{"name": "a", "parameters": [1]}', '{"name": "a", "parameters": [1]}', []),
    ("{not json", "{not json", []),
    ("<|python_tag|>print(1)", "<|python_tag|>print(1)", []),
    ("<|python_ta", "<|python_ta", []),
    ("  ", "  ", []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_extract_and_every_split_agree(text, content, calls):
    result = assert_split_invariant(Llama3JsonToolParser, text)
    assert not result.failed
    assert (result.content, result.calls) == (content, calls)
    for _, arguments in result.calls:
        json.loads(arguments)


def test_calls_only_at_the_start_of_the_output():
    parser = Llama3JsonToolParser()
    deltas = parser.feed('Sure. {"name": "a", "parameters": {}}') + parser.finish()
    assert [d.content for d in deltas] == ['Sure. {"name": "a", "parameters": {}}']
    assert parser.num_calls == 0


def test_a_bad_second_call_keeps_the_first():
    text = '{"name": "a", "parameters": {}}; {"oops": 1}'
    result = assert_split_invariant(Llama3JsonToolParser, text)
    assert result.calls == [("a", "{}")]
    assert result.content == '{"oops": 1}'


def test_a_second_arguments_key_is_a_late_failure():
    text = '{"name": "a", "parameters": {}, "arguments": {}}'
    result = assert_split_invariant(Llama3JsonToolParser, text)
    assert result.failed
    assert (result.content, result.calls) == (text, [])
