"""JsonCursor accepts exactly strict JSON and reports value/key spans at the right depths."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aserve.server.tool_parsers.json_cursor import (
    KEY_END,
    KEY_START,
    VALUE_END_AT,
    VALUE_END_BEFORE,
    VALUE_START,
    JsonCursor,
)


def _strict_loads(text: str):
    def no_constants(name):
        raise ValueError(name)

    return json.loads(text, parse_constant=no_constants)


def _cursor_accepts(text: str) -> bool:
    cursor = JsonCursor()
    return all(cursor.feed(ch) for ch in text) and cursor.done


def _python_accepts(text: str) -> bool:
    try:
        value = _strict_loads(text)
    except ValueError:
        return False
    return isinstance(value, (dict, list))  # the cursor serves containers at top level


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12,
)
containers = st.one_of(st.lists(json_values, max_size=4), st.dictionaries(st.text(max_size=5), json_values))


@settings(max_examples=150, deadline=None)
@given(containers, st.booleans(), st.booleans())
def test_accepts_every_serialized_container(value, ensure_ascii, indent):
    text = json.dumps(value, ensure_ascii=ensure_ascii, indent=2 if indent else None)
    assert _cursor_accepts(text)


@settings(max_examples=250, deadline=None)
@given(containers, st.data())
def test_agrees_with_json_loads_on_mutations(value, data):
    text = json.dumps(value)
    i = data.draw(st.integers(0, len(text)))
    op = data.draw(st.sampled_from(["insert", "delete", "replace"]))
    ch = data.draw(st.sampled_from(list('{}[]",:\\ -+.eE0123456789abtnrfu\x01')))
    if op == "insert":
        mutated = text[:i] + ch + text[i:]
    elif op == "delete":
        mutated = text[:i] + text[i + 1 :]
    else:
        mutated = text[:i] + ch + text[i + 1 :]
    assert _cursor_accepts(mutated) == _python_accepts(mutated), mutated


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 01}',
        '{"a": 1.}',
        '{"a": .5}',
        '{"a": 1e}',
        '{"a": -}',
        '{"a": tru}',
        '{"a": "\\x"}',
        '{"a": "\\u12g4"}',
        '{"a": "tab\there"}',
        "{a: 1}",
        '{"a" 1}',
        '{"a": 1,}',
        "[1,]",
        "[1 2]",
        '{"a": 1}}',
        '{"a": NaN}',
        "{} x",
    ],
)
def test_rejects_invalid_json(text):
    assert not _cursor_accepts(text)
    assert not _python_accepts(text)


def test_failure_is_permanent():
    cursor = JsonCursor()
    assert not cursor.feed("x")
    assert cursor.failed
    assert not cursor.feed(" ")
    assert not cursor.feed("{")


def test_reports_spans_of_members_at_depth_one():
    text = '{"name": "f", "n": 12, "args": {"k": [true]}}'
    cursor = JsonCursor()
    spans: dict[str, list[int]] = {}
    for i, ch in enumerate(text):
        assert cursor.feed(ch)
        for kind, depth in cursor.events:
            if depth == 1:
                spans.setdefault(kind, []).append(i)
    values = []
    starts, ends = spans[VALUE_START], []
    for kind in (VALUE_END_AT, VALUE_END_BEFORE):
        ends += [(i, kind) for i in spans.get(kind, [])]
    for start, (end, kind) in zip(starts, sorted(ends)):
        values.append(text[start : end + 1] if kind == VALUE_END_AT else text[start:end])
    assert values == ['"f"', "12", '{"k": [true]}']
    keys = [text[a : b + 1] for a, b in zip(spans[KEY_START], spans[KEY_END])]
    assert keys == ['"name"', '"n"', '"args"']
    assert cursor.done
