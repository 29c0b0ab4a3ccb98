"""The hermes parser on fixed model outputs, whole and streamed split at every character."""

from __future__ import annotations

import json

import pytest

from aserve.server.tool_parsers import HermesToolParser
from tests.server.tool_parsers.tool_replay import assert_split_invariant, check_shape, replay

WEATHER = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
NESTED_ARGS = (
    '{"guest": {"name": "Zoë \\"Z\\" Ødegård", "tags": ["vip", "☃"]}, '
    '"nights": 2, "price": -1.5e2, "extras": null, "path": "C:\\\\tmp\\\\x", "ok": true}'
)
NESTED = '{"name": "book", "arguments": ' + NESTED_ARGS + "}"

# (output, expected content, expected [(name, arguments)])
CASES = [
    (
        f"<tool_call>\n{WEATHER}\n</tool_call>",
        None,
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    (
        f"<tool_call>\n{WEATHER}\n</tool_call>\n<tool_call>\n{NESTED}\n</tool_call>\n",
        None,
        [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("book", NESTED_ARGS)],
    ),
    (
        f"Let me look that up.\n<tool_call>{WEATHER}</tool_call>",
        "Let me look that up.",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    (
        f"A\n<tool_call>{WEATHER}</tool_call>\nB then C\n",
        "A\nB then C\n",
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')],
    ),
    # arguments before the name: the header still comes first
    (
        '<tool_call>{"arguments": {"q": [1, {"r": 2}]}, "name": "search"}</tool_call>',
        None,
        [("search", '{"q": [1, {"r": 2}]}')],
    ),
    # no closing tag: the output ended, or the next block starts
    (f"<tool_call>{WEATHER}", None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    (
        f"<tool_call>{WEATHER}<tool_call>{WEATHER}",
        None,
        [("get_weather", '{"city": "Paris", "unit": "celsius"}')] * 2,
    ),
    # a call without arguments gets an empty object
    ('<tool_call>{"name": "now"}</tool_call>', None, [("now", "{}")]),
    # not calls: content, verbatim
    ("Just an answer, no tools.\n", "Just an answer, no tools.\n", []),
    ("I use <tool_call> tags sometimes", "I use <tool_call> tags sometimes", []),
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    (
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',
        [],
    ),
    (
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": "x"}</tool_call>',
        [],
    ),
    ('<tool_call>["f"]</tool_call>', '<tool_call>["f"]</tool_call>', []),
    ('<tool_call>{"name": "f"', '<tool_call>{"name": "f"', []),  # ended before the call was known
    ("partial <tool_ca", "partial <tool_ca", []),
    ("", None, []),
]


@pytest.mark.parametrize(("text", "content", "calls"), CASES)
def test_extract_and_every_split_agree(text, content, calls):
    result = assert_split_invariant(HermesToolParser, text)
    assert not result.failed
    assert (result.content, result.calls) == (content, calls)
    for _, arguments in result.calls:
        json.loads(arguments)


def test_arguments_are_the_models_text_unchanged():
    _, calls = HermesToolParser().extract(f"<tool_call>{NESTED}</tool_call>")
    assert calls[0].arguments == NESTED_ARGS
    assert json.loads(calls[0].arguments)["guest"]["name"] == 'Zoë "Z" Ødegård'


def test_stream_sends_header_then_fragments_as_they_arrive():
    parser = HermesToolParser()
    assert parser.feed("<tool_call>\n") == []
    assert parser.feed('{"name": "get_wea') == []  # the name is not complete yet
    head = parser.feed('ther", "arguments": {"ci')
    assert [d.tool_calls[0].to_openai() for d in head] == [
        {
            "index": 0,
            "id": head[0].tool_calls[0].id,
            "type": "function",
            "function": {"name": "get_weather", "arguments": ""},
        },
        {"index": 0, "function": {"arguments": '{"ci'}},
    ]
    assert head[0].tool_calls[0].id.startswith("call_")
    more = parser.feed('ty": "Paris"}}\n</tool_call>')
    assert [d.tool_calls[0].arguments for d in more] == ['ty": "Paris"}']
    assert parser.finish() == []
    assert parser.num_calls == 1


def test_ids_are_unique_across_calls_and_parsers():
    ids = set()
    for _ in range(20):
        _, calls = HermesToolParser().extract(
            f"<tool_call>{WEATHER}</tool_call><tool_call>{WEATHER}</tool_call>"
        )
        ids.update(c.id for c in calls)
    assert len(ids) == 40


def test_text_that_may_start_a_marker_is_held_back():
    parser = HermesToolParser()
    assert [d.content for d in parser.feed("Hi <tool")] == ["Hi"]
    assert [d.content for d in parser.feed("box> done")] == [" <toolbox> done"]


def test_a_call_broken_after_its_header_stands_in_the_stream_but_not_in_extract():
    text = '<tool_call>{"name": "f", "arguments": {"a": 1,}}</tool_call> bye'
    streamed = replay(HermesToolParser, list(text))
    assert streamed.failed
    assert streamed.calls == [("f", '{"a": 1,')]
    assert streamed.content == "}}</tool_call> bye"
    parser = HermesToolParser()
    assert parser.extract(text) == (text, [])
    assert parser.failed


def test_an_output_that_ends_inside_the_arguments_is_a_late_failure():
    text = '<tool_call>{"name": "f", "arguments": {"a": "unfinish'
    result = assert_split_invariant(HermesToolParser, text)
    assert result.failed and result.content == text and result.calls == []
    deltas = HermesToolParser().feed(text)
    assert check_shape(deltas).calls == [("f", '{"a": "unfinish')]


def test_feed_after_finish_is_an_error():
    parser = HermesToolParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
