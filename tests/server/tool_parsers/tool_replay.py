"""Replays a tool parser over chunks of an output and checks the OpenAI stream shape on the way."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from aserve.server.tool_parsers import StreamDelta, ToolParser


@dataclass(frozen=True)
class Replayed:
    content: str | None
    calls: list[tuple[str, str]]  # (name, arguments) per call, in index order
    ids: list[str]
    failed: bool


def check_shape(deltas: list[StreamDelta]) -> Replayed:
    """Asserts OpenAI's stream shape and reassembles the stream as the SDK would."""
    content: list[str] = []
    names: list[str] = []
    ids: list[str] = []
    args: list[list[str]] = []
    for d in deltas:
        assert (d.content is None) != (len(d.tool_calls) == 0), d  # content xor one tool-call delta
        if d.content is not None:
            assert d.content, "empty content delta"
            content.append(d.content)
            continue
        assert len(d.tool_calls) == 1
        tc = d.tool_calls[0]
        if tc.is_header:  # a new call: the next index, id and name once, empty arguments
            assert tc.index == len(names), (tc.index, len(names))
            assert tc.name and tc.arguments == ""
            assert tc.to_openai()["type"] == "function"
            names.append(tc.name)
            ids.append(tc.id)
            args.append([])
        else:  # then only argument fragments of the open call
            assert tc.index == len(names) - 1, "fragment for a call that is not the latest"
            assert tc.name is None and tc.arguments
            assert set(tc.to_openai()) == {"index", "function"}
            args[tc.index].append(tc.arguments)
    assert len(set(ids)) == len(ids), "tool call ids must be unique"
    text = "".join(content)
    return Replayed(text or None, [(n, "".join(a)) for n, a in zip(names, args)], ids, False)


def replay(make: Callable[[], ToolParser], chunks: list[str]) -> Replayed:
    parser = make()
    deltas: list[StreamDelta] = []
    for chunk in chunks:
        deltas += parser.feed(chunk)
    deltas += parser.finish()
    r = check_shape(deltas)
    return Replayed(r.content, r.calls, r.ids, parser.failed)


def extracted(make: Callable[[], ToolParser], text: str) -> Replayed:
    parser = make()
    content, calls = parser.extract(text)
    assert len({c.id for c in calls}) == len(calls)
    return Replayed(content, [(c.name, c.arguments) for c in calls], [c.id for c in calls], parser.failed)


def chunkings(text: str) -> Iterator[list[str]]:
    """One character at a time, then every two-way split, then the whole text."""
    yield list(text)
    for k in range(len(text) + 1):
        yield [text[:k], text[k:]]
    yield [text]


def assert_split_invariant(make: Callable[[], ToolParser], text: str) -> Replayed:
    """Every chunking streams to the same content and calls as `extract` (unless a call broke late)."""
    whole = extracted(make, text)
    for chunks in chunkings(text):
        streamed = replay(make, chunks)
        assert streamed.failed == whole.failed, chunks
        if not whole.failed:
            assert (streamed.content, streamed.calls) == (whole.content, whole.calls), chunks
    return whole
