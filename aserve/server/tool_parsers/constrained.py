"""`tool_choice` enforced by a grammar: the JSON schema to constrain to, and reading its output back.

The scheme is vLLM's:
- `tool_choice="required"`: the model writes a JSON array of one or more
  `{"name": <one of the tools>, "parameters": <that tool's arguments>}` objects (at most one when
  `parallel_tool_calls` is false). `RequiredToolChoiceParser` reads it, streaming or not.
- a named function (`{"type": "function", "function": {"name": X}}`): the model writes only the
  arguments object of X, under X's parameter schema; `NamedToolChoiceParser` turns the whole output
  into that one call.
- `"none"`, `"auto"` or no choice: no grammar (None).

Malformed `tools` or an unknown named function raise `ToolSpecError` naming the request field.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from aserve.server.tool_parsers.base import ToolParser
from aserve.server.tool_parsers.json_array import JsonArrayToolParser
from aserve.server.tool_parsers.types import StreamDelta, ToolCall, ToolCallDelta, openai_tool_call_id

_EMPTY_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


class ToolSpecError(ValueError):
    """`tools` or `tool_choice` cannot be turned into a grammar; `param` names the request field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


def _function(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type", "function") != "function":
        raise ToolSpecError(f"tools[{i}]", "only tools of type 'function' are served")
    function = tool.get("function")
    if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
        raise ToolSpecError(f"tools[{i}].function.name", "a function tool needs a non-empty name")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise ToolSpecError(f"tools[{i}].function.parameters", "must be a JSON schema object")
    return function


def _parameters(function: dict[str, Any]) -> dict[str, Any]:
    return function.get("parameters") or dict(_EMPTY_PARAMETERS)


def named_function(tool_choice: Any) -> str | None:
    """The function name a named `tool_choice` forces, or None for the string choices."""
    if isinstance(tool_choice, dict):
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
        if tool_choice.get("type", "function") != "function" or not isinstance(name, str) or not name:
            raise ToolSpecError("tool_choice", "a named tool_choice is {type: function, function: {name}}")
        return name
    return None


def tool_call_json_schema(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool = True
) -> dict[str, Any] | None:
    """The JSON schema that enforces `tool_choice` over `tools`, or None when nothing is enforced.

    "required": an array (1 item at least; at most 1 when `parallel_tool_calls` is false) of
    objects `{"name": const, "parameters": <schema>}`, one alternative per tool.
    Named function X: X's parameter schema (the output is X's arguments object).
    """
    name = named_function(tool_choice)
    if name is None and tool_choice != "required":
        return None
    if not tools:
        raise ToolSpecError("tools", f"tool_choice {tool_choice!r} needs at least one tool")
    functions = [_function(tool, i) for i, tool in enumerate(tools)]
    if name is not None:
        for function in functions:
            if function["name"] == name:
                return _parameters(function)
        raise ToolSpecError("tool_choice", f"function {name!r} is not among the request's tools")
    alternatives = [
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "enum": [function["name"]]},
                "parameters": _parameters(function),
            },
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for function in functions
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "minItems": 1,
        "items": alternatives[0] if len(alternatives) == 1 else {"anyOf": alternatives},
    }
    if not parallel_tool_calls:
        schema["maxItems"] = 1
    return schema


class RequiredToolChoiceParser(JsonArrayToolParser):
    """Reads the output of the "required" grammar: `[{"name": ..., "parameters": {...}}, ...]`.

    Streaming holds each call back (its header and argument fragments) until the call object is
    complete, then releases it as a header and one fragment with the whole arguments. So a call
    that breaks (the output ends inside it, as when max_tokens cuts it, or its JSON is invalid) was
    never streamed and can be taken back, as `extract` does: after calls that completed, it and
    the rest of the output are dropped; as the first call, it is given back as content, raw (an
    early failure in `base.py`'s terms). `failed` stays False: nothing broken is ever sent.
    """

    name = "required"

    def __init__(self, **kwargs) -> None:
        super().__init__(marker=None, args_keys=("parameters",), **kwargs)
        self._kwargs = kwargs
        self._call_start = 0  # where the open call's deltas start in `_out`
        self._dropping = False  # a call broke after calls that completed: the rest is dropped

    def _step(self, text: str, i: int) -> int:
        return len(text) if self._dropping else super()._step(text, i)

    def _sync_call(self) -> None:
        if not self._header_sent:
            self._call_start = len(self._out)
        super()._sync_call()

    def _take(self) -> list[StreamDelta]:
        out = self._out
        if self._reader is not None and self._header_sent:  # an open call: hold its deltas back
            out, self._out = out[: self._call_start], out[self._call_start :]
            self._call_start = 0
        else:
            self._out = []
        return _merge_fragments(out)

    def _fail_late(self) -> None:
        del self._out[self._call_start :]  # the broken call's held deltas: never sent
        self._num_calls -= 1
        self._header_sent = False
        if self._section_calls:
            self._section_raw = []
            self._dropping = True
        else:
            self._give_back_section()
            self._after_early_failure()

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """As the base class; but an output cut short (max_tokens) inside a later call keeps the calls
        that completed before the cut, since the grammar guarantees each of them is well formed."""
        complete = _complete_calls_prefix(text)
        if complete is not None and complete != text.strip():
            return type(self)(**self._kwargs).extract(complete)
        return super().extract(text)


def _merge_fragments(deltas: list[StreamDelta]) -> list[StreamDelta]:
    """Consecutive argument fragments of the same call merged into one delta."""
    out: list[StreamDelta] = []
    for d in deltas:
        last = out[-1].tool_calls[0] if out and out[-1].tool_calls else None
        tc = d.tool_calls[0] if d.tool_calls else None
        if tc and last and not tc.is_header and not last.is_header and tc.index == last.index:
            merged = ToolCallDelta(index=tc.index, arguments=last.arguments + tc.arguments)
            out[-1] = StreamDelta(tool_calls=(merged,))
        else:
            out.append(d)
    return out


def _complete_calls_prefix(text: str) -> str | None:
    """`[call, call, <cut>` -> `[call, call]`: the JSON array of the calls that completed, or None."""
    s = text.lstrip()
    if not s.startswith("["):
        return None
    decoder = json.JSONDecoder()
    pos, last_end = 1, None
    while True:
        while pos < len(s) and s[pos].isspace():
            pos += 1
        try:
            _, end = decoder.raw_decode(s, pos)
        except ValueError:
            break
        last_end = end
        while end < len(s) and s[end].isspace():
            end += 1
        if end >= len(s) or s[end] != ",":
            break
        pos = end + 1
    return None if last_end is None else s[:last_end] + "]"


class NamedToolChoiceParser(ToolParser):
    """Reads the output of a named-function grammar: the whole output is the arguments of `function`.

    The header is sent with the first `feed`; leading whitespace is dropped, everything else is an
    argument fragment. `extract` gives (None, [the call]).
    """

    name = "named"

    def __init__(self, function: str, new_id: Callable[[], str] = openai_tool_call_id) -> None:
        super().__init__(new_id=new_id)
        self._function = function
        self._started = False  # leading whitespace is behind us

    def feed(self, delta: str) -> list[StreamDelta]:
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._send_header()
        if not self._started:
            delta = delta.lstrip()
            self._started = bool(delta)
        if delta:
            self._out.append(StreamDelta(tool_calls=(ToolCallDelta(index=0, arguments=delta),)))
        return self._take()

    def finish(self) -> list[StreamDelta]:
        if not self._finished:
            self._send_header()
            self._finished = True
        return self._take()

    def _send_header(self) -> None:
        if self._num_calls == 0:
            self._num_calls = 1
            header = ToolCallDelta(index=0, id=self._new_id(), name=self._function)
            self._out.append(StreamDelta(tool_calls=(header,)))


def constrained_tool_parser(tool_choice: Any) -> ToolParser | None:
    """The parser for the output of `tool_call_json_schema(..., tool_choice)`, or None without one."""
    name = named_function(tool_choice)
    if name is not None:
        return NamedToolChoiceParser(name)
    if tool_choice == "required":
        return RequiredToolChoiceParser()
    return None


def tool_calls_from_constrained_output(text: str, tool_choice: Any) -> list[ToolCall]:
    """The calls in a complete grammar-constrained output (empty for a choice with no grammar)."""
    parser = constrained_tool_parser(tool_choice)
    return [] if parser is None else parser.extract(text)[1]
