"""Grammar schemas for tool_choice "required" / named, and reading the constrained output back."""

from __future__ import annotations

import json

import jsonschema
import pytest

from aserve.server.tool_parsers import (
    NamedToolChoiceParser,
    RequiredToolChoiceParser,
    ToolSpecError,
    constrained_tool_parser,
    tool_call_json_schema,
    tool_calls_from_constrained_output,
)
from tests.server.tool_parsers.tool_replay import assert_split_invariant, replay

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}
TOOLS = [WEATHER, NOW]


def test_required_schema_accepts_calls_to_the_tools_only():
    schema = tool_call_json_schema(TOOLS, "required")
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    good = [
        [{"name": "get_weather", "parameters": {"city": "Oslo"}}],
        [
            {"name": "now", "parameters": {}},
            {"name": "get_weather", "parameters": {"city": "Rome", "unit": "c"}},
        ],
    ]
    bad = [
        [],
        [{"name": "get_weather", "parameters": {}}],  # missing a required argument
        [{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "k"}}],
        [{"name": "unknown", "parameters": {}}],
        [{"name": "now"}],
        [{"name": "now", "parameters": {}, "extra": 1}],
        {"name": "now", "parameters": {}},
    ]
    assert all(validator.is_valid(x) for x in good)
    assert not any(validator.is_valid(x) for x in bad)


def test_parallel_tool_calls_false_allows_one_call():
    validator = jsonschema.Draft202012Validator(
        tool_call_json_schema(TOOLS, "required", parallel_tool_calls=False)
    )
    one = [{"name": "now", "parameters": {}}]
    assert validator.is_valid(one)
    assert not validator.is_valid(one * 2)
    assert "maxItems" not in tool_call_json_schema(TOOLS, "required")


def test_named_schema_is_the_functions_parameters():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_call_json_schema(TOOLS, choice) == WEATHER["function"]["parameters"]
    assert tool_call_json_schema(TOOLS, {"type": "function", "function": {"name": "now"}}) == {
        "type": "object",
        "properties": {},
    }


@pytest.mark.parametrize("choice", [None, "none", "auto"])
def test_no_grammar_without_a_forced_choice(choice):
    assert tool_call_json_schema(TOOLS, choice) is None
    assert constrained_tool_parser(choice) is None
    assert tool_calls_from_constrained_output("[]", choice) == []


@pytest.mark.parametrize(
    ("tools", "choice", "param"),
    [
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, "tool_choice"),
        (TOOLS, {"type": "function"}, "tool_choice"),
        ([], "required", "tools"),
        ([{"type": "retrieval"}], "required", "tools[0]"),
        ([{"type": "function", "function": {"name": ""}}], "required", "tools[0].function.name"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": []}}],
            "required",
            "tools[0].function.parameters",
        ),
    ],
)
def test_bad_tools_or_choice_name_the_field(tools, choice, param):
    with pytest.raises(ToolSpecError) as info:
        tool_call_json_schema(tools, choice)
    assert info.value.param == param


def test_required_output_reads_back_streamed_or_not():
    text = '[{"name": "get_weather", "parameters": {"city": "Zürich"}}, {"name": "now", "parameters": {}}]'
    result = assert_split_invariant(RequiredToolChoiceParser, text)
    assert result.content is None
    assert result.calls == [("get_weather", '{"city": "Zürich"}'), ("now", "{}")]
    calls = tool_calls_from_constrained_output(text, "required")
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Zürich"}),
        ("now", {}),
    ]


@pytest.mark.parametrize("cut", [
    '[{"name": "get_weather", "parameters": {"city": "Zürich"}}, {"name": "no',
    '[{"name": "get_weather", "parameters": {"city": "Zürich"}}, {"name": "now", "parameters": {',
    '[{"name": "get_weather", "parameters": {"city": "Zürich"}} ,',
])
def test_required_output_cut_by_max_tokens_keeps_the_calls_that_completed(cut):
    content, calls = RequiredToolChoiceParser().extract(cut)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Zürich"})]
    assert content is None
    assert RequiredToolChoiceParser().extract('[{"name": "get_wea') == ('[{"name": "get_wea', [])


def test_named_output_is_one_call_whatever_the_split():
    choice = {"type": "function", "function": {"name": "get_weather"}}
    text = ' {"city": "Paris", "unit": "c"}'
    (call,) = tool_calls_from_constrained_output(text, choice)
    assert (call.name, call.arguments) == ("get_weather", '{"city": "Paris", "unit": "c"}')
    assert call.id.startswith("call_")
    for k in range(len(text) + 1):
        streamed = replay(lambda: NamedToolChoiceParser("get_weather"), [text[:k], text[k:]])
        assert streamed.calls == [("get_weather", '{"city": "Paris", "unit": "c"}')]
        assert streamed.content is None


def test_named_stream_sends_the_header_first():
    parser = NamedToolChoiceParser("now")
    first = parser.feed("")
    assert len(first) == 1 and first[0].tool_calls[0].name == "now"
    assert parser.feed("{}")[0].tool_calls[0].to_openai() == {"index": 0, "function": {"arguments": "{}"}}
    assert parser.finish() == []


CUT = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": "unfinish'


def _two_and_three_way_splits(text: str):
    yield list(text)
    for i in range(len(text) + 1):
        yield [text[:i], text[i:]]
        for j in range(i, len(text) + 1, 3):
            yield [text[:i], text[i:j], text[j:]]


def test_required_stream_cut_by_max_tokens_carries_the_calls_extract_keeps():
    content, calls = RequiredToolChoiceParser().extract(CUT)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("a", '{"x": 1}')]
    for chunks in _two_and_three_way_splits(CUT):
        streamed = replay(RequiredToolChoiceParser, chunks)  # also checks the stream's shape
        assert streamed.calls == [(c.name, c.arguments) for c in calls], chunks
        assert streamed.content is None and not streamed.failed, chunks


def test_required_stream_never_sends_a_header_before_its_call_completes():
    """A call's deltas are held until its object closes, so a cut never leaves a started call behind."""
    complete = CUT.index("}}") + 2  # where call "a" closes
    for chunks in _two_and_three_way_splits(CUT):
        parser, fed = RequiredToolChoiceParser(), 0
        for chunk in chunks:
            fed += len(chunk)
            deltas = parser.feed(chunk)
            names = [tc.name for d in deltas for tc in d.tool_calls if tc.is_header]
            assert names == (["a"] if fed >= complete > fed - len(chunk) else []), chunks
        assert parser.finish() == [], chunks
        assert parser.num_calls == 1


@pytest.mark.parametrize("text", [
    # invalid JSON (no grammar) after a call that completed: dropped with the rest, as extract does
    '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": 1]}',
    '[{"name": "b", "parameters": {"y": "unf',  # broken first call: content, raw, as extract says
    '[{"name": "b", "parameters": {"y": 1]} tail',
])
def test_required_stream_drops_a_broken_call_as_extract_does(text):
    whole = assert_split_invariant(RequiredToolChoiceParser, text)
    assert not whole.failed and "b" not in [name for name, _ in whole.calls]


def test_required_complete_output_streams_every_call_once_complete():
    text = '[{"name": "a", "parameters": {"x": [1, {"z": "}"}]}}, {"name": "b", "parameters": {}}]'
    result = assert_split_invariant(RequiredToolChoiceParser, text)
    assert (result.content, result.calls) == (None, [("a", '{"x": [1, {"z": "}"}]}'), ("b", "{}")])
    parser = RequiredToolChoiceParser()
    deltas = parser.feed(text) + parser.finish()
    # each call comes as its header and one fragment with the whole arguments
    assert [tc.to_openai()["function"] for d in deltas for tc in d.tool_calls] == [
        {"name": "a", "arguments": ""}, {"arguments": '{"x": [1, {"z": "}"}]}'},
        {"name": "b", "arguments": ""}, {"arguments": "{}"},
    ]
