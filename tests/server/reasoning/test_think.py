"""deepseek_r1 and qwen3 reasoning parsers: fixed outputs, whole and streamed split at every character."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aserve.server.reasoning import (
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
    ThinkParser,
    get_reasoning_parser,
    reasoning_end_marker,
)


def _stream(parser: ThinkParser, chunks: list[str]) -> tuple[str | None, str | None]:
    reasoning, content = [], []
    for chunk in [*chunks, None]:
        r, c = parser.finish() if chunk is None else parser.feed(chunk)
        assert r != "" and c != "", "empty deltas are None"
        reasoning.append(r or "")
        content.append(c or "")
    return "".join(reasoning) or None, "".join(content) or None


def _chunkings(text: str):
    yield list(text)
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]


def _assert_split_invariant(make, text):
    whole = make().extract(text)
    for chunks in _chunkings(text):
        assert _stream(make(), chunks) == whole, chunks
    return whole


BOTH = [
    ("<think>\nStep 1. Step 2.\n</think>\n\nThe answer is 4.", ("\nStep 1. Step 2.\n", "The answer is 4.")),
    ("  <think>a < b </thin k></think>done", ("a < b </thin k>", "done")),
    ("<think>unterminated thought", ("unterminated thought", None)),
    ("<think>partial end </thi", ("partial end </thi", None)),
    ("<think></think>", (None, None)),
    ("<think>x</think>  ", ("x", None)),
    ("<think>é ☃</think>ünïcode</think><think>", ("é ☃", "ünïcode</think><think>")),
]
DEEPSEEK_ONLY = [  # no opening tag: the template opened the block
    ("thinking first</think>\n\nthen answer", ("thinking first", "then answer")),
    ("no end tag at all", ("no end tag at all", None)),
    ("  <thin", ("  <thin", None)),
    ("", (None, None)),
]
QWEN_ONLY = [  # no opening tag: plain content
    ("thinking first</think>\n\nthen answer", (None, "thinking first</think>\n\nthen answer")),
    ("Just an answer.\n", (None, "Just an answer.\n")),
    ("  <thin", (None, "  <thin")),
    ("a <think>b</think>", (None, "a <think>b</think>")),
    ("", (None, None)),
]


@pytest.mark.parametrize(("text", "expected"), BOTH + DEEPSEEK_ONLY)
def test_deepseek_r1(text, expected):
    assert _assert_split_invariant(DeepSeekR1ReasoningParser, text) == expected


@pytest.mark.parametrize(("text", "expected"), BOTH + QWEN_ONLY)
def test_qwen3(text, expected):
    assert _assert_split_invariant(Qwen3ReasoningParser, text) == expected


pieces = st.lists(
    st.sampled_from(["<think>", "</think>", "<", "</", "<thi", "x", " ", "\n", "é", "think>"]), max_size=12
)


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([DeepSeekR1ReasoningParser, Qwen3ReasoningParser]), pieces, st.data())
def test_any_output_streams_like_extract_under_random_splits(cls, parts, data):
    text = "".join(parts)
    whole = cls().extract(text)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert _stream(cls(), chunks) == whole
    reasoning, content = whole
    # nothing is invented: the parts are the text minus the tags and whitespace the rules drop
    assert len(reasoning or "") + len(content or "") <= len(text)


def test_partial_tags_are_held_back():
    parser = Qwen3ReasoningParser()
    assert parser.feed("<thi") == (None, None)
    assert parser.feed("nk>Hmm </th") == ("Hmm ", None)
    assert not parser.reasoning_ended
    assert parser.feed("ink>\nYes") == (None, "Yes")
    assert parser.reasoning_ended
    assert parser.finish() == (None, None)


def test_prompt_decides_where_the_output_starts():
    opened = Qwen3ReasoningParser.for_prompt("<|im_start|>assistant\n<think>\n")
    assert opened.extract("because</think>42") == ("because", "42")
    closed = DeepSeekR1ReasoningParser.for_prompt("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed.extract("42 </think> x") == (None, "42 </think> x")
    assert closed.reasoning_ended
    neutral = DeepSeekR1ReasoningParser.for_prompt("User: hi\nAssistant:")
    assert neutral.extract("hmm</think>42") == ("hmm", "42")


@pytest.mark.parametrize(
    ("cls", "text", "offset"),
    [
        (DeepSeekR1ReasoningParser, "abc</think>{}", 11),
        (DeepSeekR1ReasoningParser, "abc", None),
        (Qwen3ReasoningParser, "<think>abc</think> {}", 18),
        (Qwen3ReasoningParser, "<thi", None),
        (Qwen3ReasoningParser, "{}", 0),
        (Qwen3ReasoningParser, "<think>still", None),
    ],
)
def test_content_offset_marks_where_a_grammar_may_start(cls, text, offset):
    assert cls().content_offset(text) == offset
    if offset is not None:
        assert cls().extract(text)[1] == (text[offset:].lstrip() or None)


def test_registry_and_end_marker():
    assert get_reasoning_parser("deepseek_r1") is DeepSeekR1ReasoningParser
    assert get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    assert reasoning_end_marker("qwen3") == "</think>"
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        get_reasoning_parser("granite")


def test_feed_after_finish_is_an_error():
    parser = DeepSeekR1ReasoningParser()
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")
