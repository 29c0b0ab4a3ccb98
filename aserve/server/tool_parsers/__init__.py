"""Tool-call parsing for the OpenAI chat API: model text -> content + OpenAI-shaped tool calls.

`get_tool_parser(name)` gives the parser class for a `--tool-call-parser` name (vLLM's names);
make one instance per choice. Each parser offers `extract(text) -> (content | None, [ToolCall])`
for a complete output and `feed(delta) -> [StreamDelta]` / `finish() -> [StreamDelta]` for a
stream; see `base.py` for the shared contract. `constrained.py` builds the grammar schema that
enforces `tool_choice="required"` or a named function and reads its output back; `prompt.py`
renders `tools` as a hermes-style system block. Nothing here imports torch.
"""

from __future__ import annotations

from types import MappingProxyType

from aserve.server.tool_parsers.base import ToolParser
from aserve.server.tool_parsers.constrained import (
    NamedToolChoiceParser,
    RequiredToolChoiceParser,
    ToolSpecError,
    constrained_tool_parser,
    named_function,
    tool_call_json_schema,
    tool_calls_from_constrained_output,
)
from aserve.server.tool_parsers.hermes import HermesToolParser
from aserve.server.tool_parsers.json_array import MistralToolParser
from aserve.server.tool_parsers.llama3_json import Llama3JsonToolParser
from aserve.server.tool_parsers.prompt import (
    hermes_tool_calls_text,
    render_hermes_tools_prompt,
    with_tools_system_prompt,
)
from aserve.server.tool_parsers.types import StreamDelta, ToolCall, ToolCallDelta

TOOL_PARSERS = MappingProxyType(
    {cls.name: cls for cls in (HermesToolParser, Llama3JsonToolParser, MistralToolParser)}
)
"""`--tool-call-parser` name -> parser class (read-only)."""


def get_tool_parser(name: str) -> type[ToolParser]:
    """The parser class registered as `name`; ValueError listing the known names otherwise."""
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(TOOL_PARSERS))}"
        ) from None


__all__ = [
    "TOOL_PARSERS",
    "HermesToolParser",
    "Llama3JsonToolParser",
    "MistralToolParser",
    "NamedToolChoiceParser",
    "RequiredToolChoiceParser",
    "StreamDelta",
    "ToolCall",
    "ToolCallDelta",
    "ToolParser",
    "ToolSpecError",
    "constrained_tool_parser",
    "get_tool_parser",
    "hermes_tool_calls_text",
    "named_function",
    "render_hermes_tools_prompt",
    "tool_call_json_schema",
    "tool_calls_from_constrained_output",
    "with_tools_system_prompt",
]
