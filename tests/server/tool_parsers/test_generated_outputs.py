"""Property: any well-formed output in each format parses to its calls, however the stream is split."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from aserve.server.tool_parsers import HermesToolParser, Llama3JsonToolParser, MistralToolParser
from tests.server.tool_parsers.tool_replay import extracted, replay

names = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,12}", fullmatch=True)
scalars = (
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)
arguments = st.dictionaries(st.text(max_size=6), values, max_size=4)
calls = st.lists(st.tuples(names, arguments), min_size=1, max_size=3)
dump_options = st.fixed_dictionaries({"ensure_ascii": st.booleans(), "indent": st.sampled_from([None, 1])})


def _object(name, args, args_key, opts, name_first):
    pairs = [("name", name), (args_key, args)] if name_first else [(args_key, args), ("name", name)]
    return json.dumps(dict(pairs), **opts)


def _render(fmt, call_list, opts, name_first, prefix):
    if fmt == "hermes":
        blocks = "\n".join(
            f"<tool_call>\n{_object(n, a, 'arguments', opts, name_first)}\n</tool_call>" for n, a in call_list
        )
        return HermesToolParser, prefix + blocks
    if fmt == "llama3_json":
        return Llama3JsonToolParser, "; ".join(
            _object(n, a, "parameters", opts, name_first) for n, a in call_list
        )
    body = ", ".join(_object(n, a, "arguments", opts, name_first) for n, a in call_list)
    return MistralToolParser, f"{prefix}[TOOL_CALLS][{body}]"


@settings(max_examples=150, deadline=None)
@given(
    st.sampled_from(["hermes", "llama3_json", "mistral"]),
    calls,
    dump_options,
    st.booleans(),
    st.sampled_from(["", "Let me call a tool.\n", "Sure: "]),
    st.data(),
)
def test_rendered_calls_round_trip_under_random_splits(fmt, call_list, opts, name_first, prefix, data):
    make, text = _render(fmt, call_list, opts, name_first, prefix)
    whole = extracted(make, text)
    assert not whole.failed
    assert [(n, json.loads(a)) for n, a in whole.calls] == call_list
    expected_content = prefix.strip() or None if fmt != "llama3_json" else None
    assert whole.content == expected_content
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    streamed = replay(make, chunks)
    assert (streamed.content, streamed.calls, streamed.failed) == (whole.content, whole.calls, False)
